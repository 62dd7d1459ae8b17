// Where a fused optimizer's state lives: `streams` flat buffers (exp_avg, exp_avg_sq, ...) of
// `elements` elements each, in memory or in a file (ZeRO-Infinity's NVMe offload on any file
// system).
//
// The file store keeps two chunk buffers in memory and streams the state through them on a
// background thread: while the step updates chunk i in one buffer, the thread writes chunk
// i-1 back from the other and reads chunk i+1 into it. File layout: chunk after chunk, each
// holding its elements of stream 0, then of stream 1, ..., so one chunk is one read and one
// write at an aligned offset (what O_DIRECT requires).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include <fsdp/optim/fused_optimizer.h>

namespace fsdp::detail {

class StateStore {
 public:
  /// fn(begin, end, state): update elements [begin, end); state[s] points at element `begin`
  /// of stream s.
  using ChunkFn = std::function<void(int64_t begin, int64_t end, void* const* state)>;

  virtual ~StateStore() = default;

  /// Calls fn on the chunks that intersect `ranges` (sorted, disjoint element ranges), in
  /// order; a file store reads each before and writes it back after.
  virtual void for_each_chunk(const std::vector<std::pair<int64_t, int64_t>>& ranges,
                              const ChunkFn& fn, OptimizerStepStats& stats) = 0;
  /// Copies n elements of stream s starting at `begin` out of / into the store.
  virtual void read(int stream, int64_t begin, int64_t n, void* out) = 0;
  virtual void write(int stream, int64_t begin, int64_t n, const void* in) = 0;
  /// The memory store's buffer of stream s, bytes (allocated on first use); undefined for a
  /// file store.
  virtual torch::Tensor memory(int stream) = 0;
  virtual int64_t resident_bytes() const = 0;
  virtual std::string info() const = 0;

  int64_t total_bytes() const { return streams_ * elements_ * element_size_; }

 protected:
  StateStore(int streams, int64_t elements, int64_t element_size)
      : streams_(streams), elements_(elements), element_size_(element_size) {}
  int streams_;
  int64_t elements_;
  int64_t element_size_;
};

std::unique_ptr<StateStore> make_memory_store(int streams, int64_t elements, int64_t element_size);
/// Checks the directory, creates the file and reserves its full size: every problem with the
/// directory is an error here, before the first step.
std::unique_ptr<StateStore> make_file_store(int streams, int64_t elements, int64_t element_size,
                                            const OptimizerStateOptions& options);

}  // namespace fsdp::detail
