// See gloo_loop_policy.h.
#include "gloo_loop_policy.h"

#include <sched.h>

#include "env_switch.h"

namespace fsdp::detail {

BatchPolicyForNewThreads::BatchPolicyForNewThreads() {
  if (!env_switch("FSDP_GLOO_LOOP_BATCH", true) || ::sched_getscheduler(0) != SCHED_OTHER)
    return;
  sched_param param{};
  param.sched_priority = 0;
  // A refusal (a sandbox without the call) leaves Gloo's loop as it always was: not an error.
  changed_ = ::sched_setscheduler(0, SCHED_BATCH, &param) == 0;
}

BatchPolicyForNewThreads::~BatchPolicyForNewThreads() {
  if (!changed_)
    return;
  sched_param param{};
  param.sched_priority = 0;
  ::sched_setscheduler(0, SCHED_OTHER, &param);
}

}  // namespace fsdp::detail
