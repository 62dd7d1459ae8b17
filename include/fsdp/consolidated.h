// Deprecated: the old path of <fsdp/checkpoint/consolidated.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/consolidated.h> is deprecated: include <fsdp/checkpoint/consolidated.h>"
#include <fsdp/checkpoint/consolidated.h>
