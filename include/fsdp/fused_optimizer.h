// Deprecated: the old path of <fsdp/optim/fused_optimizer.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/fused_optimizer.h> is deprecated: include <fsdp/optim/fused_optimizer.h>"
#include <fsdp/optim/fused_optimizer.h>
