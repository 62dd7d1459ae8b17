// See include/fsdp/checkpoint/consolidated.h for what is guaranteed.
#include <fsdp/checkpoint/consolidated.h>

#include <fsdp/distributed/collectives.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/core/durable_file.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/state_dict.h>

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using safetensors::FormatError;

TensorLayout layout_of(const ConsolidatedOptions& options, const std::string& name,
                       c10::IntArrayRef shape) {
  TensorLayout l = options.layout ? options.layout(name, shape) : TensorLayout{name};
  TORCH_CHECK(!l.name.empty(), "fsdp consolidated file: parameter '", name,
              "' is mapped to an empty name");
  if (l.kind == TensorLayout::Kind::kTransposed) {
    TORCH_CHECK(shape.size() == 2, "fsdp consolidated file: parameter '", name,
                "' is mapped transposed but has ", shape.size(), " dimensions");
  } else if (l.kind == TensorLayout::Kind::kRowPermuted) {
    const int64_t rows = shape.empty() ? 1 : shape[0];
    std::vector<bool> seen(static_cast<size_t>(rows), false);
    TORCH_CHECK(static_cast<int64_t>(l.file_row.size()) == rows,
                "fsdp consolidated file: ", "the row order of parameter '", name, "' has ",
                l.file_row.size(), " entries for ", rows, " rows");
    for (const int64_t r : l.file_row) {
      TORCH_CHECK(r >= 0 && r < rows && !seen[static_cast<size_t>(r)],
                  "fsdp consolidated file: the row order of parameter '", name,
                  "' is not a permutation");
      seen[static_cast<size_t>(r)] = true;
    }
  }
  return l;
}

std::vector<int64_t> file_shape(const TensorLayout& l, c10::IntArrayRef shape) {
  auto s = shape.vec();
  if (l.kind == TensorLayout::Kind::kTransposed)
    std::swap(s[0], s[1]);
  return s;
}

// Rows [row, row + rows) of the parameter are rows [file_row, file_row + rows) of the file.
struct RowRun {
  int64_t row, file_row, rows;
};

// The parameter's rows [begin, begin + rows) as runs of consecutive file rows.
std::vector<RowRun> row_runs(const TensorLayout& l, int64_t begin, int64_t rows) {
  std::vector<RowRun> runs;
  for (int64_t r = begin; r < begin + rows; ++r) {
    const int64_t f = l.kind == TensorLayout::Kind::kRowPermuted ? l.file_row[r] : r;
    if (!runs.empty() && runs.back().file_row + runs.back().rows == f)
      ++runs.back().rows;
    else
      runs.push_back({r, f, 1});
  }
  return runs;
}

// Rows of `s` per message to rank 0: the I/O buffer, at least one row.
int64_t slab_rows(const ParamShard& s, int64_t buffer_bytes) {
  int64_t row = s.shard.element_size();
  for (size_t d = 1; d < s.global_shape.size(); ++d)
    row *= s.global_shape[d];
  return std::max<int64_t>(1, buffer_bytes / std::max<int64_t>(1, row));
}

std::vector<int64_t> rows_shape(const ParamShard& s, int64_t rows) {
  std::vector<int64_t> shape{rows};
  for (size_t i = 1; i < s.global_shape.size(); ++i)
    shape.push_back(s.global_shape[i]);
  return shape;
}

// Reads the file's rows [file_row, file_row + dst.size(0)) of `entry` into dst: straight into
// its memory when the dtypes agree, else through a staging slab of bounded size.
void read_rows_into(const safetensors::Reader& reader, const safetensors::TensorEntry& entry,
                    int64_t file_row, const torch::Tensor& dst, int64_t buffer_bytes) {
  const uint64_t row_bytes = entry.row_bytes();
  if (dst.scalar_type() == entry.dtype && dst.is_contiguous() && dst.is_cpu()) {
    reader.read_bytes(entry, static_cast<uint64_t>(file_row) * row_bytes,
                      static_cast<uint64_t>(dst.size(0)) * row_bytes, dst.data_ptr());
    return;
  }
  const int64_t slab =
      std::max<int64_t>(1, buffer_bytes / static_cast<int64_t>(std::max<uint64_t>(1, row_bytes)));
  for (int64_t r = 0; r < dst.size(0); r += slab) {
    const int64_t n = std::min(slab, dst.size(0) - r);
    dst.narrow(0, r, n).copy_(reader.read_rows(entry.name, file_row + r, n));
  }
}

std::vector<ParamShard> selected_shards(torch::nn::Module& model,
                                        const ConsolidatedOptions& options) {
  auto shards = param_shards(model);
  if (options.include)
    std::erase_if(shards, [&](const ParamShard& s) { return !options.include(s.name); });
  return shards;
}

}  // namespace

void save_consolidated(const std::string& path, torch::nn::Module& model, ProcessGroup& group,
                       const ConsolidatedOptions& options) {
  torch::NoGradGuard no_grad;
  // Every rank sees the same file system: all refuse together, before any collective.
  TORCH_CHECK(!fs::exists(path), "fsdp::save_consolidated: ", path,
              " exists (files are never overwritten)");
  const auto shards = selected_shards(model, options);
  const int rank = group.rank(), world = group.size();
  const auto n = static_cast<int64_t>(shards.size());

  // Which rows every rank is the first holder of, so that rank 0 knows what to receive.
  auto mine = torch::zeros({std::max<int64_t>(n, 1), 2}, torch::kLong);
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = shards[static_cast<size_t>(i)];
    mine[i][0] = s.row_begin;
    mine[i][1] = s.writer ? s.rows : 0;
  }
  const auto device = c10::Device(group.device_type());
  auto in = mine.to(device);
  auto all = torch::empty({world, in.size(0), 2}, in.options());
  all_gather(group, {in}, {all}, 0, "save_consolidated")->wait();

  std::vector<TensorLayout> layouts;
  for (const auto& s : shards)
    layouts.push_back(layout_of(options, s.name, s.global_shape));
  auto transposed = [&](int64_t i) {
    return layouts[static_cast<size_t>(i)].kind == TensorLayout::Kind::kTransposed;
  };

  // Rows travel to rank 0 in slabs of at most io_buffer_bytes, tagged by their order among the
  // messages of their sender; both sides compute the same slabs. A slab of a transposed
  // parameter travels transposed: every sender does its share of the transposing.
  if (rank != 0) {
    int tag = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto& s = shards[static_cast<size_t>(i)];
      if (!s.writer || s.rows == 0)
        continue;
      const auto shard = s.shard.contiguous();
      for (int64_t r = 0, slab = slab_rows(s, options.io_buffer_bytes); r < s.rows; r += slab) {
        auto rows = shard.narrow(0, r, std::min(slab, s.rows - r));
        send(group, transposed(i) ? rows.t().contiguous() : rows, 0, tag++, "save_consolidated")
            ->wait();
      }
    }
    group.barrier();
    return;
  }

  std::vector<at::Tensor> table;  // per rank: [n, 2] (first row, rows it writes)
  for (int r = 0; r < world; ++r)
    table.push_back(all[r].cpu());
  std::vector<safetensors::TensorSpec> specs;
  std::set<std::string> names;
  auto stored = [&](torch::ScalarType t) {
    return options.dtype && at::isFloatingType(t) ? *options.dtype : t;
  };
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& layout = layouts[i];
    TORCH_CHECK(names.insert(layout.name).second, "fsdp::save_consolidated: two tensors named '",
                layout.name, "'");
    specs.push_back({layout.name, stored(shards[i].shard.scalar_type()),
                     file_shape(layout, shards[i].global_shape)});
  }
  for (const auto& [name, t] : options.extra_tensors) {
    TORCH_CHECK(names.insert(name).second, "fsdp::save_consolidated: extra tensor '", name,
                "' has the name of a parameter's tensor");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  std::vector<int> tags(static_cast<size_t>(world), 0);  // per sender, as it counts them
  const std::string tmp = path + ".tmp";
  try {
    fs::remove(tmp);  // a save that died half-way
    safetensors::Writer writer(tmp, specs, options.metadata);
    for (int64_t i = 0; i < n; ++i) {
      const auto& s = shards[static_cast<size_t>(i)];
      const auto& layout = layouts[static_cast<size_t>(i)];
      const auto dtype = stored(s.shard.scalar_type());
      // A transposed parameter is assembled whole, in the file's layout, before it is written
      // (its rows are the file's columns); the others are written slab by slab as they arrive.
      torch::Tensor whole;
      if (transposed(i))
        whole =
            torch::empty(file_shape(layout, s.global_shape), s.shard.options().device(torch::kCPU));
      // Global rows [begin, begin + rows) of the parameter; `slab` as sent (transposed or not).
      auto put = [&](int64_t begin, int64_t rows, const torch::Tensor& slab) {
        if (whole.defined()) {
          whole.narrow(1, begin, rows).copy_(slab);
          return;
        }
        for (const auto& run : row_runs(layout, begin, rows))
          writer.write_rows(layout.name, run.file_row,
                            slab.narrow(0, run.row - begin, run.rows).to(dtype));
      };
      // The other ranks' slabs, in order; each one's receive is posted before the previous one
      // is written, so the network and the disk work at the same time (two slabs in memory).
      struct Message {
        int rank;
        int64_t begin, rows;
      };
      std::vector<Message> messages;
      int64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        const auto ru = static_cast<size_t>(r);
        const int64_t begin = table[ru][i][0].item<int64_t>();
        const int64_t rows = table[ru][i][1].item<int64_t>();
        covered += rows;
        for (int64_t k = 0, slab = slab_rows(s, options.io_buffer_bytes); r > 0 && k < rows;
             k += slab)
          messages.push_back({r, begin + k, std::min(slab, rows - k)});
      }
      auto post = [&](const Message& m) {
        auto shape = rows_shape(s, m.rows);
        if (whole.defined())
          std::swap(shape[0], shape[1]);
        auto buf = torch::empty(shape, s.shard.options());
        auto work =
            recv(group, buf, m.rank, tags[static_cast<size_t>(m.rank)]++, "save_consolidated");
        return std::make_pair(std::move(work), buf);
      };
      std::optional<std::pair<std::unique_ptr<CollectiveWork>, torch::Tensor>> next;
      if (!messages.empty())
        next = post(messages.front());
      const int64_t own = table[0][i][1].item<int64_t>();
      if (own > 0)
        put(table[0][i][0].item<int64_t>(), own, whole.defined() ? s.shard.t() : s.shard);
      for (size_t k = 0; k < messages.size(); ++k) {
        auto [work, buf] = std::move(*next);
        work->wait();
        next.reset();
        if (k + 1 < messages.size())
          next = post(messages[k + 1]);
        put(messages[k].begin, messages[k].rows, buf);
      }
      const int64_t global_rows = s.global_shape.empty() ? 1 : s.global_shape[0];
      TORCH_CHECK(covered == global_rows, "fsdp::save_consolidated: the ranks hold ", covered,
                  " rows of '", s.name, "', which has ", global_rows);
      if (whole.defined())
        writer.write(layout.name, whole.to(dtype));
    }
    for (const auto& [name, t] : options.extra_tensors)
      writer.write(name, t);
    writer.finish();
    rename_durably(tmp, path);
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  group.barrier();
}

std::map<std::string, std::string> load_consolidated(const std::string& path,
                                                     torch::nn::Module& model,
                                                     const ConsolidatedOptions& options) {
  return load_consolidated(std::vector<std::string>{path}, model, options);
}

std::map<std::string, std::string> load_consolidated(const std::vector<std::string>& paths,
                                                     torch::nn::Module& model,
                                                     const ConsolidatedOptions& options) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(!paths.empty(), "fsdp consolidated file: no file to load from");
  std::vector<std::unique_ptr<safetensors::Reader>> readers;
  // Which file holds each tensor; one held by two files is ambiguous, whichever we chose.
  std::map<std::string, const safetensors::Reader*> holder;
  for (const auto& p : paths) {
    readers.push_back(std::make_unique<safetensors::Reader>(p));
    for (const auto& t : readers.back()->header().tensors) {
      auto [it, fresh] = holder.emplace(t.name, readers.back().get());
      if (!fresh)
        throw FormatError(p + ": tensor '" + t.name + "' is also in " + it->second->path());
    }
  }
  const std::string where = paths.size() == 1 ? paths[0] : paths[0] + " (and its other files)";
  for (const auto& s : selected_shards(model, options)) {
    const auto layout = layout_of(options, s.name, s.global_shape);
    const auto found = holder.find(layout.name);
    if (found == holder.end())
      throw FormatError(where + ": no tensor '" + layout.name + "' for parameter '" + s.name + "'");
    const auto& reader = *found->second;
    const auto* entry = reader.header().find(layout.name);
    const std::string what =
        reader.path() + ": tensor '" + layout.name + "' (parameter '" + s.name + "')";
    if (!at::isFloatingType(entry->dtype))
      throw FormatError(what + " is " + safetensors::dtype_name(entry->dtype) +
                        ", not a floating-point type");
    const auto want = file_shape(layout, s.global_shape);
    if (entry->shape != want)
      throw FormatError(what + " has shape " + c10::str(c10::IntArrayRef(entry->shape)) +
                        ", the model expects " + c10::str(c10::IntArrayRef(want)));
    if (s.rows == 0)
      continue;
    if (layout.kind != TensorLayout::Kind::kTransposed) {
      for (const auto& run : row_runs(layout, s.row_begin, s.rows))
        read_rows_into(reader, *entry, run.file_row,
                       s.shard.narrow(0, run.row - s.row_begin, run.rows), options.io_buffer_bytes);
      continue;
    }
    // The shard's rows [b, b + rows) are columns [b, b + rows) of every file row: read just
    // those bytes, a slab of file rows at a time.
    const int64_t file_rows = entry->shape[0];
    const uint64_t elem = torch::elementSize(entry->dtype);
    const uint64_t piece_bytes = static_cast<uint64_t>(s.rows) * elem;
    const int64_t slab = std::max<int64_t>(
        1, options.io_buffer_bytes / static_cast<int64_t>(std::max<uint64_t>(1, piece_bytes)));
    for (int64_t c = 0; c < file_rows; c += slab) {
      const int64_t m = std::min(slab, file_rows - c);
      auto staging = torch::empty({m, s.rows}, torch::TensorOptions().dtype(entry->dtype));
      auto* dst = static_cast<char*>(staging.data_ptr());
      for (int64_t k = 0; k < m; ++k)
        reader.read_bytes(*entry,
                          static_cast<uint64_t>(c + k) * entry->row_bytes() +
                              static_cast<uint64_t>(s.row_begin) * elem,
                          piece_bytes, dst + static_cast<uint64_t>(k) * piece_bytes);
      s.shard.narrow(1, c, m).copy_(staging.t());
    }
  }
  return readers.front()->header().metadata;
}

}  // namespace fsdp
