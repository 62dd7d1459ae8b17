// How the fused optimizers lay their state out and what of it stays in memory: FusedOptimizer
// places each parameter's slot by it and the state stores size their buffers by it, and the
// planner predicts the optimizer's memory from the same functions (fsdp::plan's model states).
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp::detail {

/// Each parameter's slot in the flat state starts at a multiple of 64 elements (whole cache
/// lines for the kernels' vector loads): a slot of `numel` elements takes this many.
constexpr int64_t kSlotAlign = 64;
constexpr int64_t slot_elements(int64_t numel) {
  return (numel + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

/// The file store's unit of I/O and alignment (O_DIRECT: offsets, sizes and addresses).
constexpr int64_t kStateFileAlign = 4096;

/// The file store's chunk, in elements of each stream: whole 4096-element blocks (every
/// stream's part then starts aligned), about `chunk_bytes` for all streams together, no more
/// than the state rounded up to a block, at least one block.
constexpr int64_t state_chunk_elements(int streams, int64_t elements, int64_t element_size,
                                       int64_t chunk_bytes) {
  const int64_t per_element = streams * element_size;
  int64_t chunk =
      std::max<int64_t>(1, chunk_bytes / per_element / kStateFileAlign) * kStateFileAlign;
  chunk = std::min(chunk, (elements + kStateFileAlign - 1) / kStateFileAlign * kStateFileAlign);
  return std::max<int64_t>(chunk, kStateFileAlign);
}

/// One stream's buffer of an in-memory state: at least a byte (an empty tensor has no pointer).
constexpr int64_t state_stream_bytes(int64_t elements, int64_t element_size) {
  return std::max<int64_t>(elements * element_size, 1);
}

/// What a state of `streams` streams of `elements` elements of `element_size` bytes keeps in
/// memory once allocated: in memory, a buffer per stream (at least a byte each); in a file
/// (`in_file`), two chunk buffers, each 4096 bytes over for alignment.
constexpr int64_t state_resident_bytes(bool in_file, int streams, int64_t elements,
                                       int64_t element_size, int64_t chunk_bytes) {
  if (!in_file)
    return streams * state_stream_bytes(elements, element_size);
  const int64_t stride =
      state_chunk_elements(streams, elements, element_size, chunk_bytes) * streams * element_size;
  return 2 * (stride + kStateFileAlign);
}

}  // namespace fsdp::detail
