// See include/fsdp/checkpoint/sharded_checkpoint.h for the layout and the guarantees.
#include <fsdp/checkpoint/sharded_checkpoint.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <thread>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/core/durable_file.h>
#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/distributed/store_latch.h>
#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/state_dict.h>

#include "checkpoint_index.h"
#include "sharded_checkpoint_hooks.h"

namespace fsdp {
namespace detail {
std::function<void(int rank, const std::string& stage)> save_sharded_hook;
}  // namespace detail
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using safetensors::FormatError;

// Rows per checksum block: about this many bytes, so a reader that needs a few rows reads and
// verifies little more than those.
constexpr uint64_t kBlockBytes = 4ull << 20;

using Box = WholeBlock;

// Where a rank's shard of a parameter lies in the whole tensor: its boxes, the whole shape, and
// whether it is split over the tp group (a different part on each rank).
struct Placement {
  std::vector<int64_t> whole_shape;
  std::vector<Box> boxes;
  bool split = false;
};

Placement place(const ParamShard& l, const TensorParallelLayout& tp) {
  const auto it = tp.parts.find(l.name);
  const TensorPart* part = it == tp.parts.end() ? nullptr : &it->second;
  return {whole_shape(part, l.global_shape, l.name),
          whole_blocks(part, l.global_shape, l.row_begin, l.rows, l.name), part != nullptr};
}

// One tensor of the checkpoint as this rank holds it: the rows of a parameter or of one of its
// optimizer state tensors (same layout as the parameter).
struct Entry {
  std::string key;  // "model/<name>" or "optim/<name>/<state>"
  ParamShard layout;
  Placement place;
  torch::Tensor data;  // this rank's rows, [rows, ...]
  // State kept in a file (a fused optimizer's offload) is read only when its turn comes, so
  // saving holds one tensor of it at a time; `data` is undefined until then.
  std::function<torch::Tensor()> fetch;
  torch::Dtype dtype = torch::kFloat32;
};

std::string optimizer_kind(torch::optim::Optimizer* opt) {
  if (!opt)
    return "";
  // The fused optimizers save under torch's names: their checkpoints load into torch's
  // optimizers and the other way round.
  if (auto* fused = dynamic_cast<FusedOptimizer*>(opt))
    return fused->state_kind();
  if (dynamic_cast<torch::optim::AdamW*>(opt))
    return "adamw";
  if (dynamic_cast<torch::optim::Adam*>(opt))
    return "adam";
  if (dynamic_cast<torch::optim::SGD*>(opt))
    return "sgd";
  TORCH_CHECK(false,
              "fsdp sharded checkpoint: optimizer state of this kind is not supported (AdamW, "
              "Adam and SGD are)");
}

// The state tensors of one parameter, by name (missing ones: undefined), and its step.
struct ParamOptState {
  std::map<std::string, torch::Tensor> tensors;
  int64_t step = 0;
  bool exists = false;
  torch::Dtype dtype = torch::kFloat32;  // of lazily read tensors
};

// `lazy`: a fused optimizer's offloaded state is named but not read (see Entry::fetch).
ParamOptState read_opt_state(torch::optim::Optimizer& opt, const std::string& kind,
                             const torch::Tensor& param, bool lazy = false) {
  ParamOptState out;
  if (auto* fused = dynamic_cast<FusedOptimizer*>(&opt)) {
    if (!fused->owns(param))
      return out;  // a frozen parameter: no state
    if (!lazy || fused->state_in_memory()) {
      out.tensors = fused->get_state(param, &out.step);
    } else {  // names only: save reads each tensor from the file when it writes it
      fused->get_state_step(param, &out.step);
      if (out.step > 0)
        for (const auto& name : fused->state_names())
          out.tensors[name] = torch::Tensor();
      out.dtype = fused->state_options().moments_dtype();
    }
    out.exists = out.step > 0;
    return out;  // (torch's SGD ignores the step count FusedSGD saves)
  }
  auto it = opt.state().find(param.unsafeGetTensorImpl());
  if (it == opt.state().end())
    return out;
  out.exists = true;
  if (kind == "adamw") {
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out.step = s.step();
    out.tensors = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
    if (s.max_exp_avg_sq().defined())
      out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  } else if (kind == "adam") {
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    out.step = s.step();
    out.tensors = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
    if (s.max_exp_avg_sq().defined())
      out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  } else {
    auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
    if (s.momentum_buffer().defined())
      out.tensors["momentum_buffer"] = s.momentum_buffer();
  }
  return out;
}

// Rows of a state tensor shaped like the param's data at rest ([rows, ...]; a 0-d parameter
// outside any unit is one row).
torch::Tensor as_rows(const torch::Tensor& t) {
  return t.dim() == 0 ? t.reshape({1}) : t;
}

std::vector<int64_t> rows_shape(const ParamShard& l, int64_t rows) {
  std::vector<int64_t> shape{rows};
  for (size_t i = 1; i < l.global_shape.size(); ++i)
    shape.push_back(l.global_shape[i]);
  return shape;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t checksum(const torch::Tensor& rows) {
  auto c = rows.to(torch::kCPU).contiguous();
  return XXH3_64bits(c.data_ptr(), c.numel() * c.element_size());
}

}  // namespace

namespace {

// A save's plan on this rank: where it goes, and the rows it writes (those it is the first holder
// of) with the optimizer's kind and per-parameter step counts.
struct SavePlan {
  fs::path final_dir, tmp;
  std::string file;  // rank-<r>.safetensors
  std::string kind;
  Json steps = Json::object();
  std::vector<Entry> entries;
};

// Refuses an existing `dir` (every rank sees the same file system: all refuse together, before
// any collective), makes <dir>.tmp afresh (rank 0; the others wait) and lists the entries.
SavePlan plan_save(const std::string& dir, torch::nn::Module& model,
                   torch::optim::Optimizer* optimizer, ProcessGroup& group,
                   const TensorParallelLayout& tp) {
  SavePlan plan;
  plan.final_dir = dir;
  plan.tmp = plan.final_dir.string() + ".tmp";
  TORCH_CHECK(!fs::exists(plan.final_dir), "fsdp::save_sharded: ", dir,
              " exists (checkpoints are never overwritten)");
  const int rank = group.rank();
  if (rank == 0) {
    fs::remove_all(plan.tmp);  // a save that died half-way
    fs::create_directories(plan.tmp);
  }
  group.barrier();
  plan.kind = optimizer_kind(optimizer);
  auto params = model.named_parameters(/*recurse=*/true);
  for (auto& l : param_shards(model)) {
    const auto& param = params[l.name];
    ParamOptState st;
    if (optimizer)
      st = read_opt_state(*optimizer, plan.kind, param, /*lazy=*/true);
    if (st.exists)
      plan.steps[l.name] = st.step;
    Placement where = place(l, tp);
    // Whole tensors of a tp group are written by its first rank; a split one by every rank.
    if (!l.writer || where.boxes.empty() || !(where.split || tp.writes_whole))
      continue;
    plan.entries.push_back({"model/" + l.name, l, where, l.shard, {}, l.shard.scalar_type()});
    for (auto& [name, t] : st.tensors)
      plan.entries.push_back(
          {"optim/" + l.name + "/" + name, l, where, t.defined() ? as_rows(t) : t,
           t.defined() ? std::function<torch::Tensor()>()
                       : [fused = dynamic_cast<FusedOptimizer*>(optimizer), param,
                          name] { return as_rows(fused->state_tensor(param, name)); },
           t.defined() ? t.scalar_type() : st.dtype});
  }
  char file_buf[32];
  std::snprintf(file_buf, sizeof file_buf, "rank-%05d.safetensors", rank);
  plan.file = file_buf;
  return plan;
}

std::vector<safetensors::TensorSpec> specs_of(const std::vector<Entry>& entries) {
  std::vector<safetensors::TensorSpec> specs;
  for (const auto& e : entries)
    specs.push_back({e.key, e.dtype, rows_shape(e.layout, e.layout.rows)});
  return specs;
}

// The index's entry for `e` (its data at hand): the whole tensor's dtype and shape, and a piece
// per box: its file, rows (and columns, and first row in the file, where not the defaults), and
// a checksum per block of rows of about kBlockBytes.
Json pieces_of(const Entry& e, const std::string& file) {
  uint64_t row_bytes = c10::elementSize(e.data.scalar_type());
  for (size_t i = 1; i < e.layout.global_shape.size(); ++i)
    row_bytes *= static_cast<uint64_t>(e.layout.global_shape[i]);
  const int64_t block_rows =
      std::max<int64_t>(1, static_cast<int64_t>(kBlockBytes / std::max<uint64_t>(1, row_bytes)));
  const auto& whole = e.place.whole_shape;
  Json pieces = Json::array();
  for (const Box& box : e.place.boxes) {
    Json sums = Json::array();
    for (int64_t r = 0; r < box.rows; r += block_rows)
      sums.push_back(
          hex(checksum(e.data.narrow(0, box.at + r, std::min(block_rows, box.rows - r)))));
    Json piece = {{"file", file},
                  {"rows", {box.row, box.row + box.rows}},
                  {"block_rows", block_rows},
                  {"xxh3", sums}};
    if (box.at != 0)
      piece["at"] = box.at;
    if (whole.size() >= 2 && (box.col != 0 || box.cols != whole[1]))
      piece["cols"] = {box.col, box.col + box.cols};
    pieces.push_back(std::move(piece));
  }
  return {{"dtype", safetensors::dtype_name(e.data.scalar_type())},
          {"shape", whole},
          {"pieces", pieces}};
}

// index.json from every rank's pieces (rank r's JSON text at r).
std::string build_index(const std::vector<std::string>& all_pieces, const SavePlan& plan,
                        const std::map<std::string, std::string>& metadata) {
  const int world = static_cast<int>(all_pieces.size());
  Json tensors = Json::object();
  for (int r = 0; r < world; ++r) {
    auto theirs = Json::parse(all_pieces[static_cast<size_t>(r)]);
    for (auto& [key, entry] : theirs.items()) {
      auto& t = tensors[key];
      if (t.is_null())
        t = {{"dtype", entry["dtype"]}, {"shape", entry["shape"]}, {"pieces", Json::array()}};
      TORCH_CHECK(t["dtype"] == entry["dtype"] && t["shape"] == entry["shape"],
                  "fsdp::save_sharded: ranks disagree on the whole dtype or shape of '", key, "' (",
                  t["shape"].dump(), " and ", entry["shape"].dump(), " from rank ", r,
                  "): their tensor-parallel layouts do not fit together");
      for (auto& piece : entry["pieces"])
        t["pieces"].push_back(piece);
    }
  }
  Json index = {{"format", detail::kIndexFormat},
                {"version", detail::kIndexVersion},
                {"world_size", world},
                {"metadata", metadata},
                {"optimizer", {{"kind", plan.kind}, {"steps", plan.steps}}},
                {"tensors", tensors}};
  index[detail::kIndexChecksumKey] = detail::index_checksum(index.dump());
  return index.dump(1);
}

// Rank 0: the index from every rank's pieces, gathered with a collective (the other ranks get "").
std::string gather_index(ProcessGroup& group, const Json& pieces, const SavePlan& plan,
                         const std::map<std::string, std::string>& metadata) {
  const auto all_pieces = all_gather_bytes(group, pieces.dump(), "save_sharded index");
  return group.rank() == 0 ? build_index(all_pieces, plan, metadata) : "";
}

// Rank 0, once every rank's file is durable: the index last, then the directory renamed into
// place, so that a crash before leaves only <dir>.tmp, which no reader takes for a checkpoint.
void commit(const SavePlan& plan, const std::string& index) {
  write_file_atomic((plan.tmp / "index.json").string(), index);
  rename_durably(plan.tmp.string(), plan.final_dir.string());
}

}  // namespace

void save_sharded(const std::string& dir, torch::nn::Module& model,
                  torch::optim::Optimizer* optimizer, ProcessGroup& group,
                  const std::map<std::string, std::string>& metadata,
                  const TensorParallelLayout& tp) {
  torch::NoGradGuard no_grad;
  SavePlan plan = plan_save(dir, model, optimizer, group, tp);
  Json pieces = Json::object();
  if (!plan.entries.empty()) {
    safetensors::Writer w((plan.tmp / plan.file).string(), specs_of(plan.entries));
    for (auto& e : plan.entries) {
      if (!e.data.defined())
        e.data = e.fetch();
      w.write_rows(e.key, 0, e.data);
      pieces[e.key] = pieces_of(e, plan.file);
      if (e.fetch)
        e.data = torch::Tensor();  // the next one replaces it
    }
    w.finish();
  }
  if (detail::save_sharded_hook)
    detail::save_sharded_hook(group.rank(), "files_written");
  const std::string index = gather_index(group, pieces, plan, metadata);
  if (group.rank() == 0)
    commit(plan, index);
  group.barrier();
}

struct AsyncCheckpointer::Save {
  SavePlan plan;
  std::unique_ptr<safetensors::Image> image;  // the snapshot: the rank's file, in memory
  std::map<std::string, std::string> metadata;
  std::function<void()> after_commit;  // rank 0's
  std::unique_ptr<StoreLatch> written;
  std::chrono::milliseconds timeout{0};
  int rank = 0;
  std::thread writer;
  std::exception_ptr error;
  AsyncSaveResult result;
};

AsyncCheckpointer::AsyncCheckpointer(std::shared_ptr<ProcessGroup> group)
    : group_(std::move(group)) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp::AsyncCheckpointer: the save in flight failed: %s\n", e.what());
  }
}

void AsyncCheckpointer::start(const std::string& dir, torch::nn::Module& model,
                              torch::optim::Optimizer* optimizer,
                              const std::map<std::string, std::string>& metadata,
                              const TensorParallelLayout& tp, std::function<void()> after_commit) {
  wait();  // at most one save in flight
  torch::NoGradGuard no_grad;
  const auto begin = std::chrono::steady_clock::now();
  auto save = std::make_unique<Save>();
  save->plan = plan_save(dir, model, optimizer, *group_, tp);
  save->metadata = metadata;
  save->rank = group_->rank();
  save->timeout = group_->timeout();
  save->after_commit = std::move(after_commit);
  // The snapshot, all the training thread does: every row this rank writes copied, before
  // training changes them, into the image of its file on the host (the writer then puts the
  // image on disk without copying it again). Their checksums and the index are the writer's:
  // each rank's writer leaves its pieces in the store as it counts itself written, and rank 0's
  // builds the index from them (a collective would have to run here, on the training thread).
  if (!save->plan.entries.empty()) {
    const auto specs = specs_of(save->plan.entries);
    if (!spare_ || !spare_->holds(specs))
      spare_.reset();  // freed before the new one is made
    save->image = spare_ ? std::move(spare_) : std::make_unique<safetensors::Image>(specs);
  }
  for (auto& e : save->plan.entries) {
    torch::Tensor rows = e.data.defined() ? e.data : e.fetch();
    torch::Tensor slot = save->image->slot(e.key);
    TORCH_CHECK(rows.numel() == slot.numel() && rows.scalar_type() == slot.scalar_type(),
                "fsdp::AsyncCheckpointer: '", e.key, "' is ", rows.numel(), " x ",
                c10::toString(rows.scalar_type()), ", its place in the file ", slot.numel(), " x ",
                c10::toString(slot.scalar_type()));
    slot.copy_(rows.reshape(slot.sizes()));
    e.data = slot;
    e.fetch = nullptr;
    save->result.bytes += static_cast<int64_t>(e.data.nbytes());
  }
  // Named by the save's number too: a directory saved again in the same job (after a failed
  // attempt) must not find the earlier attempt's count.
  save->written = std::make_unique<StoreLatch>(
      *group_, "async-save/" + std::to_string(saves_started_++) + "/" + dir);
  save->result.dir = dir;
  save->result.stall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  Save* s = save.get();
  s->writer = std::thread([s, begin] {
    // The writer yields to training (the lowest priority of the normal policy: on a machine whose
    // cores all compute it still gets a little, so it finishes within the group's timeout).
    setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19);
    try {
      Json pieces = Json::object();
      if (s->image) {
        s->image->write((s->plan.tmp / s->plan.file).string());
        for (const auto& e : s->plan.entries)
          pieces[e.key] = pieces_of(e, s->plan.file);
        s->plan.entries.clear();  // the image stays, for the next save (wait())
      }
      if (detail::save_sharded_hook)
        detail::save_sharded_hook(s->rank, "files_written");
      s->written->arrive(pieces.dump());
      if (s->rank == 0) {
        if (!s->written->wait(s->timeout)) {
          try {
            s->written->discard();
          } catch (const std::exception&) {
            // The store out of reach too: the error below is the one to report.
          }
          throw std::runtime_error("fsdp::AsyncCheckpointer: " + s->plan.final_dir.string() +
                                   ": not every rank wrote its file within the group's timeout; "
                                   "the checkpoint was not committed (the previous one stays "
                                   "the latest)");
        }
        commit(s->plan, build_index(s->written->take_notes(), s->plan, s->metadata));
        if (s->after_commit)
          s->after_commit();
      }
    } catch (...) {
      s->error = std::current_exception();
    }
    s->result.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  });
  in_flight_ = std::move(save);
}

void AsyncCheckpointer::set_group(std::shared_ptr<ProcessGroup> group) {
  TORCH_CHECK(group, "fsdp::AsyncCheckpointer::set_group: no group");
  if (group == group_)
    return;
  group_ = std::move(group);
  // The latches' names count saves per group: every member of the new one starts from 0 (a
  // rank that joined it later has made fewer saves than the others).
  saves_started_ = 0;
}

std::optional<AsyncSaveResult> AsyncCheckpointer::wait() {
  if (!in_flight_)
    return std::nullopt;
  auto save = std::move(in_flight_);
  save->writer.join();
  spare_ = std::move(save->image);
  if (save->error)
    std::rethrow_exception(save->error);
  return save->result;
}

namespace {

// The reader of `file` of the checkpoint in `dir`, opened on first use.
safetensors::Reader& reader_of(
    const fs::path& dir, const std::string& file,
    std::map<std::string, std::unique_ptr<safetensors::Reader>>& readers) {
  auto& reader = readers[file];
  if (!reader) {
    // The index names plain files of this directory (checkpoint_index.cpp refuses '/' and
    // '..'); a link could still lead elsewhere, and a device or FIFO could block or never
    // end: only regular files are read.
    const fs::path path = dir / file;
    std::error_code ec;
    const auto status = fs::symlink_status(path, ec);
    if (!ec && status.type() != fs::file_type::regular)
      throw FormatError(path.string() +
                        ": not a regular file (the checkpoint index may only "
                        "name files of its own directory; links and devices are refused)");
    reader = std::make_unique<safetensors::Reader>(path.string());
  }
  return *reader;
}

// Checks that the file's tensor `key` can hold piece `p` of `t`: the dtype, at least the rows
// from p.at, and the piece's columns.
void check_file_tensor(const safetensors::Reader& reader, const std::string& key,
                       const detail::IndexTensor& t, const detail::Piece& p) {
  const auto& entry = reader.entry(key);
  std::vector<int64_t> tail;
  if (t.shape.size() >= 2) {
    tail.assign(t.shape.begin() + 1, t.shape.end());
    tail[0] = p.col_end - p.col_begin;
  }
  const bool fits =
      entry.dtype == t.dtype && !entry.shape.empty() &&
      entry.shape[0] >= p.at + (p.end - p.begin) &&
      std::equal(entry.shape.begin() + 1, entry.shape.end(), tail.begin(), tail.end());
  if (!fits)
    throw FormatError(reader.path() + ": tensor '" + key +
                      "' has another dtype or shape than the index says");
}

// Reads box `box` of the whole tensor `key` into dst (box.rows rows of the box's columns), block
// by verified block, from every piece it meets.
void read_box_into(const fs::path& dir, const std::string& key, const detail::IndexTensor& t,
                   const Box& box, const torch::Tensor& dst,
                   std::map<std::string, std::unique_ptr<safetensors::Reader>>& readers) {
  const bool by_cols = t.shape.size() >= 2;
  const int64_t end = box.row + box.rows;
  for (const auto& p : t.pieces) {
    const int64_t lo = std::max(box.row, p.begin), hi = std::min(end, p.end);
    const int64_t clo = std::max(box.col, p.col_begin);
    const int64_t chi = std::min(box.col + box.cols, p.col_end);
    if (lo >= hi || (by_cols && clo >= chi))
      continue;
    auto& reader = reader_of(dir, p.file, readers);
    check_file_tensor(reader, key, t, p);
    for (int64_t b = (lo - p.begin) / p.block_rows; b * p.block_rows + p.begin < hi; ++b) {
      const int64_t bb = p.begin + b * p.block_rows;
      const int64_t bl = std::min(p.block_rows, p.end - bb);
      auto block = reader.read_rows(key, p.at + bb - p.begin, bl);
      if (checksum(block) != p.sums[static_cast<size_t>(b)])
        throw FormatError(reader.path() + ": tensor '" + key + "' rows [" + std::to_string(bb) +
                          ", " + std::to_string(bb + bl) +
                          "): checksum mismatch (the file is corrupted)");
      const int64_t ol = std::max(lo, bb), oh = std::min(hi, bb + bl);
      if (ol >= oh)
        continue;
      auto from = block.narrow(0, ol - bb, oh - ol);
      auto to = dst.narrow(0, ol - box.row, oh - ol);
      if (by_cols) {
        from = from.narrow(1, clo - p.col_begin, chi - clo);
        to = to.narrow(1, clo - box.col, chi - clo);
      }
      to.copy_(from);
    }
  }
}

}  // namespace

std::map<std::string, std::string> read_checkpoint_metadata(const std::string& dir) {
  return detail::parse_index((fs::path(dir) / "index.json").string()).metadata;
}

std::map<std::string, std::string> load_sharded(const std::string& dir, torch::nn::Module& model,
                                                torch::optim::Optimizer* optimizer,
                                                const TensorParallelLayout& tp) {
  torch::NoGradGuard no_grad;
  const fs::path root(dir);
  const auto index = detail::parse_index((root / "index.json").string());
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers;
  auto params = model.named_parameters(/*recurse=*/true);
  const std::string kind = optimizer_kind(optimizer);
  if (optimizer && index.optimizer_kind != kind)
    throw FormatError((root / "index.json").string() + ": optimizer state is '" +
                      index.optimizer_kind + "', the optimizer given is '" + kind + "'");
  auto load = [&](const std::string& key, const Placement& where, const torch::Tensor& dst) {
    auto it = index.tensors.find(key);
    if (it == index.tensors.end())
      throw FormatError(dir + ": the checkpoint has no tensor '" + key + "'");
    if (it->second.shape != where.whole_shape)
      throw FormatError(dir + ": tensor '" + key + "' was saved with another shape (" +
                        c10::str(c10::IntArrayRef(it->second.shape)) + ", the model's is " +
                        c10::str(c10::IntArrayRef(where.whole_shape)) + ")");
    auto staging =
        it->second.dtype == dst.scalar_type() && dst.is_contiguous() && dst.is_cpu()
            ? dst
            : torch::empty(dst.sizes(), dst.options().dtype(it->second.dtype).device(torch::kCPU));
    for (const Box& box : where.boxes)
      read_box_into(root, key, it->second, box, staging.narrow(0, box.at, box.rows), readers);
    if (!staging.is_same(dst))
      dst.copy_(staging);
  };
  for (const auto& l : param_shards(model)) {
    const Placement where = place(l, tp);
    load("model/" + l.name, where, l.shard);
    if (!optimizer)
      continue;
    const auto& param = params[l.name];
    auto step = index.steps.find(l.name);
    auto* fused = dynamic_cast<FusedOptimizer*>(optimizer);
    if (fused && !fused->owns(param)) {  // frozen here (LoRA's base): it must have no state
      if (step != index.steps.end())
        throw FormatError(dir + ": the checkpoint has optimizer state for '" + l.name +
                          "', which the optimizer given does not train");
      continue;
    }
    if (step == index.steps.end()) {  // it had no state when saved
      if (fused)
        fused->set_state(param, {}, 0);
      else
        optimizer->state().erase(param.unsafeGetTensorImpl());
      continue;
    }
    // State tensors the optimizer already has are loaded in place: no second copy of the
    // state exists at any moment (a rank's extra memory stays one block of rows). A fused
    // optimizer's in-memory state comes back as views of its buffers; offloaded state is not
    // read at all (it is about to be replaced): each tensor is loaded into a temporary and
    // written to the file before the next one.
    const ParamOptState old = fused && !fused->state_in_memory()
                                  ? ParamOptState{}
                                  : read_opt_state(*optimizer, kind, param);
    auto make = [&](const std::string& name) {
      auto it = old.tensors.find(name);
      auto t = it != old.tensors.end() && it->second.sizes() == param.sizes() &&
                       it->second.scalar_type() == param.scalar_type()
                   ? it->second
                   : torch::zeros_like(param);
      load("optim/" + l.name + "/" + name, where, as_rows(t));
      return t;
    };
    auto has = [&](const std::string& name) {
      return index.tensors.count("optim/" + l.name + "/" + name) > 0;
    };
    if (fused) {
      bool any = false;
      for (const auto& name : fused->state_names()) {
        any = any || has(name);
        fused->set_state_tensor(param, name, has(name) ? make(name) : torch::Tensor());
      }
      // torch's SGD saves no step count; a momentum buffer means it has stepped.
      fused->set_step(param,
                      kind == "sgd" && any ? std::max<int64_t>(step->second, 1) : step->second);
      continue;
    }
    std::unique_ptr<torch::optim::OptimizerParamState> state;
    if (kind == "adamw") {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(step->second).exp_avg(make("exp_avg")).exp_avg_sq(make("exp_avg_sq"));
      if (has("max_exp_avg_sq"))
        s->max_exp_avg_sq(make("max_exp_avg_sq"));
      state = std::move(s);
    } else if (kind == "adam") {
      auto s = std::make_unique<torch::optim::AdamParamState>();
      s->step(step->second).exp_avg(make("exp_avg")).exp_avg_sq(make("exp_avg_sq"));
      if (has("max_exp_avg_sq"))
        s->max_exp_avg_sq(make("max_exp_avg_sq"));
      state = std::move(s);
    } else {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      if (has("momentum_buffer"))
        s->momentum_buffer(make("momentum_buffer"));
      state = std::move(s);
    }
    optimizer->state()[param.unsafeGetTensorImpl()] = std::move(state);
  }
  return index.metadata;
}

}  // namespace fsdp
