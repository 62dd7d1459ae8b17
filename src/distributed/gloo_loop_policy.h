// The scheduling policy of Gloo's event-loop threads. Private to src/distributed.
//
// Gloo's TCP transport runs one event-loop thread per device ("gloo_tcp_loop"). When data
// arrives on a pair whose lock another thread holds (a collective's thread writing to the same
// socket), the loop does not wait for the lock: it returns to epoll_wait, which reports the
// still-unread socket again at once, and it spins until the lock is free. Worse, as a freshly
// woken thread it preempts the very thread it waits for. Measured on our 2-core machines (two
// processes, torch 2.15's Gloo, all_reduce of 1,000 floats): 1.1-1.4 ms per call and 0.7-0.9 ms
// of CPU, of which the loop threads took most; with the loops under SCHED_BATCH (no wakeup
// preemption, otherwise an ordinary fair share), 0.43 ms and 0.30 ms. Gloo comes inside
// LibTorch, so its loop cannot be changed; the policy of its thread can: a thread inherits the
// policy of the thread that creates it, and the loop is created with its device.
#pragma once

namespace fsdp::detail {

/// While alive, the calling thread runs under SCHED_BATCH, so that the threads it creates (Gloo's
/// event loop, created with its device) inherit that policy; the thread's own policy is restored
/// on destruction. Does nothing when the thread runs under another policy than SCHED_OTHER (a
/// real-time thread keeps its own) or when FSDP_GLOO_LOOP_BATCH=0.
class BatchPolicyForNewThreads {
 public:
  BatchPolicyForNewThreads();
  ~BatchPolicyForNewThreads();
  BatchPolicyForNewThreads(const BatchPolicyForNewThreads&) = delete;
  BatchPolicyForNewThreads& operator=(const BatchPolicyForNewThreads&) = delete;

 private:
  bool changed_ = false;
};

}  // namespace fsdp::detail
