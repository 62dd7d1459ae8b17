// Deprecated: the old path of <fsdp/activation_checkpoint.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/checkpoint.h> is deprecated: include <fsdp/activation_checkpoint.h>"
#include <fsdp/activation_checkpoint.h>
