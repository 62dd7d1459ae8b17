// Deprecated: the old path of <fsdp/distributed/process_group.h>, kept for one release (0.1 ->
// 0.2).
#pragma once
#pragma GCC warning \
    "<fsdp/process_group.h> is deprecated: include <fsdp/distributed/process_group.h>"
#include <fsdp/distributed/process_group.h>
