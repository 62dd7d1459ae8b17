// Deprecated: the old path of <fsdp/distributed/cuda.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/cuda.h> is deprecated: include <fsdp/distributed/cuda.h>"
#include <fsdp/distributed/cuda.h>
