// Deprecated: the old path of <fsdp/core/durable_file.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/durable_file.h> is deprecated: include <fsdp/core/durable_file.h>"
#include <fsdp/core/durable_file.h>
