// Deprecated: the old path of <fsdp/observe/step_profiler.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/step_profiler.h> is deprecated: include <fsdp/observe/step_profiler.h>"
#include <fsdp/observe/step_profiler.h>
