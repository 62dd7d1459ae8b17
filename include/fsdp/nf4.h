// Deprecated: the old path of <fsdp/quant/nf4.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/nf4.h> is deprecated: include <fsdp/quant/nf4.h>"
#include <fsdp/quant/nf4.h>
