// Deprecated: the old path of <fsdp/detail/tensor_visit.h>, kept for one release (0.1 -> 0.2).
#pragma once
#pragma GCC warning "<fsdp/tensor_visit.h> is deprecated: include <fsdp/detail/tensor_visit.h>"
#include <fsdp/detail/tensor_visit.h>
