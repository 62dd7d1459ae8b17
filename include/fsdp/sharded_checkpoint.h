// Deprecated: the old path of <fsdp/checkpoint/sharded_checkpoint.h>, kept for one release (0.1 ->
// 0.2).
#pragma once
#pragma GCC warning \
    "<fsdp/sharded_checkpoint.h> is deprecated: include <fsdp/checkpoint/sharded_checkpoint.h>"
#include <fsdp/checkpoint/sharded_checkpoint.h>
