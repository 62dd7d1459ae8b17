// Deprecated: the old path of <fsdp/core/memory.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/memory.h> is deprecated: include <fsdp/core/memory.h>"
#include <fsdp/core/memory.h>
