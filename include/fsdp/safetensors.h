// Deprecated: the old path of <fsdp/checkpoint/safetensors.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/safetensors.h> is deprecated: include <fsdp/checkpoint/safetensors.h>"
#include <fsdp/checkpoint/safetensors.h>
