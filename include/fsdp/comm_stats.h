// Deprecated: the old path of <fsdp/distributed/comm_stats.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/comm_stats.h> is deprecated: include <fsdp/distributed/comm_stats.h>"
#include <fsdp/distributed/comm_stats.h>
