#include "optimizer_state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <torch/torch.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <fsdp/core/file.h>
#include <fsdp/core/memory.h>
#include <fsdp/optim/state_layout.h>

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kAlign = kStateFileAlign;  // O_DIRECT: offsets, sizes and addresses

// A buffer aligned for O_DIRECT, allocated as a tensor so the memory accounting counts it
// (under kOptimizer).
struct AlignedBuffer {
  torch::Tensor storage;
  char* data = nullptr;
  explicit AlignedBuffer(int64_t bytes) {
    memory::CategoryScope scope(memory::Category::kOptimizer);
    storage = torch::empty({bytes + kAlign}, torch::kUInt8);
    auto addr = reinterpret_cast<uintptr_t>(storage.data_ptr());
    data = reinterpret_cast<char*>((addr + kAlign - 1) / kAlign * kAlign);
  }
};

class MemoryStore final : public StateStore {
 public:
  MemoryStore(int streams, int64_t elements, int64_t element_size)
      : StateStore(streams, elements, element_size) {}

  void for_each_chunk(const std::vector<std::pair<int64_t, int64_t>>& ranges, const ChunkFn& fn,
                      OptimizerStepStats&) override {
    if (ranges.empty())
      return;
    std::vector<void*> ptrs;
    for (int s = 0; s < streams_; ++s)
      ptrs.push_back(memory(s).data_ptr());
    fn(0, elements_, ptrs.data());
  }
  void read(int stream, int64_t begin, int64_t n, void* out) override {
    std::memcpy(out, static_cast<char*>(memory(stream).data_ptr()) + begin * element_size_,
                n * element_size_);
  }
  void write(int stream, int64_t begin, int64_t n, const void* in) override {
    char* dst = static_cast<char*>(memory(stream).data_ptr()) + begin * element_size_;
    if (dst != in)  // a view of this very state, loaded in place
      std::memmove(dst, in, n * element_size_);
  }
  // Allocated on first use, as torch's optimizers allocate their state in the first step.
  torch::Tensor memory(int stream) override {
    if (buffers_.empty()) {
      memory::CategoryScope scope(memory::Category::kOptimizer);
      for (int s = 0; s < streams_; ++s)
        buffers_.push_back(
            torch::zeros({state_stream_bytes(elements_, element_size_)}, torch::kUInt8));
    }
    return buffers_[stream];
  }
  int64_t resident_bytes() const override { return buffers_.empty() ? 0 : total_bytes(); }
  std::string info() const override { return ""; }

 private:
  std::vector<torch::Tensor> buffers_;
};

// One background thread that runs I/O jobs in order.
class IoThread {
 public:
  IoThread() : thread_([this] { run(); }) {}
  ~IoThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  std::future<void> submit(std::function<void()> job) {
    std::packaged_task<void()> task(std::move(job));
    auto future = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(task));
    }
    cv_.notify_one();
    return future;
  }

 private:
  void run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty())
          return;
        task = std::move(jobs_.front());
        jobs_.pop_front();
      }
      task();  // an exception is stored in the task's future
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

class FileStore final : public StateStore {
 public:
  FileStore(int streams, int64_t elements, int64_t element_size,
            const OptimizerStateOptions& options)
      : StateStore(streams, elements, element_size) {
    const int64_t per_element = streams * element_size;
    chunk_elems_ = state_chunk_elements(streams, elements, element_size, options.chunk_bytes());
    num_chunks_ = (elements + chunk_elems_ - 1) / chunk_elems_;
    stride_ = chunk_elems_ * per_element;
    // The buffers first: if they cannot be allocated, no file has been reserved yet.
    buffers_.emplace_back(stride_);
    buffers_.emplace_back(stride_);
    open_file(options);
  }

  ~FileStore() override {
    io_.reset();  // joins the thread: no job touches the file after this (closed by file_)
  }

  void for_each_chunk(const std::vector<std::pair<int64_t, int64_t>>& ranges, const ChunkFn& fn,
                      OptimizerStepStats& stats) override {
    // The chunks that hold any element of `ranges`.
    std::vector<int64_t> chunks;
    for (const auto& [b, e] : ranges) {
      if (e <= b)
        continue;
      for (int64_t c = b / chunk_elems_; c <= (e - 1) / chunk_elems_; ++c)
        if (chunks.empty() || chunks.back() < c)
          chunks.push_back(c);
    }
    if (chunks.empty())
      return;
    const int64_t read0 = bytes_read_, written0 = bytes_written_;
    std::future<void> pending[2];
    auto read_job = [this](int64_t c, int b) { return [this, c, b] { read_chunk(c, b); }; };
    pending[0] = io_->submit(read_job(chunks[0], 0));
    if (chunks.size() > 1)
      pending[1] = io_->submit(read_job(chunks[1], 1));
    auto drain = [&] {
      for (auto& p : pending)
        if (p.valid())
          p.wait();
    };
    try {
      for (size_t k = 0; k < chunks.size(); ++k) {
        const int b = static_cast<int>(k % 2);
        const auto t0 = std::chrono::steady_clock::now();
        pending[b].get();  // chunk k is in buffer b (and whatever used b before is written)
        stats.io_wait_seconds +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const int64_t c = chunks[k];
        const int64_t begin = c * chunk_elems_, end = std::min(elements_, begin + chunk_elems_);
        std::vector<void*> ptrs;
        for (int s = 0; s < streams_; ++s)
          ptrs.push_back(buffers_[b].data + s * chunk_elems_ * element_size_);
        fn(begin, end, ptrs.data());
        const bool more = k + 2 < chunks.size();
        const int64_t next = more ? chunks[k + 2] : -1;
        pending[b] = io_->submit([this, c, b, next] {
          write_chunk(c, b);
          if (next >= 0)
            read_chunk(next, b);
        });
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& p : pending)
        if (p.valid())
          p.get();
      stats.io_wait_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } catch (...) {
      drain();  // no job may still use the buffers when the error propagates
      throw;
    }
    stats.bytes_read += bytes_read_ - read0;
    stats.bytes_written += bytes_written_ - written0;
  }

  void read(int stream, int64_t begin, int64_t n, void* out) override {
    copy_blocks(stream, begin, n, [&](char* block, int64_t off, int64_t bytes, int64_t done) {
      std::memcpy(static_cast<char*>(out) + done, block + off, bytes);
      return false;
    });
  }
  void write(int stream, int64_t begin, int64_t n, const void* in) override {
    copy_blocks(stream, begin, n, [&](char* block, int64_t off, int64_t bytes, int64_t done) {
      std::memcpy(block + off, static_cast<const char*>(in) + done, bytes);
      return true;
    });
  }
  torch::Tensor memory(int) override { return {}; }
  int64_t resident_bytes() const override { return 2 * (stride_ + kAlign); }
  std::string info() const override {
    return path_ + " (" + std::to_string(num_chunks_) + " chunk(s) of " + std::to_string(stride_) +
           " bytes, " + (direct_ ? "O_DIRECT" : "buffered") + ")";
  }

 private:
  void open_file(const OptimizerStateOptions& options) {
    const fs::path dir(options.offload_dir());
    std::error_code ec;
    const auto status = fs::status(dir, ec);
    if (!fs::exists(status))
      throw std::runtime_error("optimizer offload directory '" + dir.string() + "' does not exist");
    if (!fs::is_directory(status))
      throw std::runtime_error("optimizer offload directory '" + dir.string() +
                               "' is not a directory");
    static std::atomic<int> counter{0};
    path_ = (dir / ("fsdp-optimizer-state." + std::to_string(::getpid()) + "." +
                    std::to_string(counter++) + ".bin"))
                .string();
    // Created without O_DIRECT, which is switched on afterwards: a file system that refuses it
    // would otherwise fail the open after creating the file (and posix_fallocate's fallback,
    // for file systems without fallocate, writes single bytes, which O_DIRECT refuses).
    try {
      file_ = File(path_, O_RDWR | O_CREAT | O_EXCL, 0600, "create");
    } catch (const std::exception& e) {
      throw std::runtime_error("optimizer offload directory '" + dir.string() +
                               "': cannot create its state file (" + e.what() + ")");
    }
    // Unlinked at once: the open descriptor keeps it, a crash leaves no file behind.
    ::unlink(path_.c_str());
    const int64_t size = num_chunks_ * stride_;
    if (const int err = size > 0 ? ::posix_fallocate(file_.fd(), 0, size) : 0; err != 0) {
      struct statvfs vfs {};
      std::string free_text;
      if (::statvfs(dir.c_str(), &vfs) == 0)
        free_text =
            ", " + std::to_string(static_cast<int64_t>(vfs.f_bavail) * vfs.f_frsize) + " free";
      file_ = File();
      throw std::runtime_error("optimizer offload: cannot reserve " + std::to_string(size) +
                               " bytes for the state in '" + path_ + "': " + errno_text(err) +
                               free_text);
    }
    direct_ = false;
    if (options.direct_io()) {
      const int flags = ::fcntl(file_.fd(), F_GETFL);
      direct_ = flags >= 0 && ::fcntl(file_.fd(), F_SETFL, flags | O_DIRECT) == 0;  // EINVAL: tmpfs
    }
  }

  // The file's errors ("<path>: read failed: <reason>") with what was being moved.
  std::string transfer(const char* what, int64_t bytes, int64_t offset) const {
    return "optimizer offload file '" + path_ + "': " + what + " of " + std::to_string(bytes) +
           " bytes at offset " + std::to_string(offset) + " failed";
  }

  void pread_all(char* dst, int64_t bytes, int64_t offset) {
    uint64_t got = 0;
    try {
      got = file_.pread_some(dst, static_cast<uint64_t>(bytes), static_cast<uint64_t>(offset));
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(transfer("read", bytes, offset) + " (" + e.what() + ")");
    }
    if (got < static_cast<uint64_t>(bytes))
      throw std::runtime_error("optimizer offload file '" + path_ + "': ends at " +
                               std::to_string(offset + static_cast<int64_t>(got)) + " bytes, " +
                               std::to_string(num_chunks_ * stride_) +
                               " expected (was it truncated?)");
    bytes_read_ += bytes;
  }

  void pwrite_all(const char* src, int64_t bytes, int64_t offset) {
    try {
      file_.pwrite_all(src, static_cast<uint64_t>(bytes), static_cast<uint64_t>(offset));
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(transfer("write", bytes, offset) + " (" + e.what() + ")");
    }
    bytes_written_ += bytes;
  }

  void read_chunk(int64_t c, int b) { pread_all(buffers_[b].data, stride_, c * stride_); }
  void write_chunk(int64_t c, int b) { pwrite_all(buffers_[b].data, stride_, c * stride_); }

  // Visits the part of each stream block (one stream's elements of one chunk) that overlaps
  // [begin, begin + n), through an aligned bounce buffer; `visit` returns whether to write the
  // block back. Used by checkpoints, never during a step.
  template <class Visit>
  void copy_blocks(int stream, int64_t begin, int64_t n, Visit visit) {
    const int64_t block_bytes = chunk_elems_ * element_size_;
    // Only the 4096-byte pages that hold the elements are read (and written back).
    const int64_t max_bytes = std::min(block_bytes, (n * element_size_ / kAlign + 2) * kAlign);
    AlignedBuffer bounce(max_bytes);
    int64_t done = 0;
    for (int64_t e = begin; e < begin + n;) {
      const int64_t c = e / chunk_elems_;
      const int64_t in_chunk = e - c * chunk_elems_;
      const int64_t count = std::min(begin + n - e, chunk_elems_ - in_chunk);
      const int64_t first = in_chunk * element_size_ / kAlign * kAlign;
      const int64_t last = std::min(
          block_bytes, ((in_chunk + count) * element_size_ + kAlign - 1) / kAlign * kAlign);
      const int64_t offset = c * stride_ + stream * block_bytes + first;
      pread_all(bounce.data, last - first, offset);
      if (visit(bounce.data, in_chunk * element_size_ - first, count * element_size_, done))
        pwrite_all(bounce.data, last - first, offset);
      done += count * element_size_;
      e += count;
    }
  }

  std::string path_;
  File file_;
  bool direct_ = false;
  int64_t chunk_elems_ = 0, num_chunks_ = 0, stride_ = 0;
  std::vector<AlignedBuffer> buffers_;
  std::atomic<int64_t> bytes_read_{0}, bytes_written_{0};
  std::unique_ptr<IoThread> io_ = std::make_unique<IoThread>();
};

}  // namespace

std::unique_ptr<StateStore> make_memory_store(int streams, int64_t elements, int64_t element_size) {
  return std::make_unique<MemoryStore>(streams, elements, element_size);
}

std::unique_ptr<StateStore> make_file_store(int streams, int64_t elements, int64_t element_size,
                                            const OptimizerStateOptions& options) {
  TORCH_CHECK(options.chunk_bytes() > 0, "optimizer offload: chunk_bytes must be positive");
  return std::make_unique<FileStore>(streams, elements, element_size, options);
}

}  // namespace fsdp::detail
