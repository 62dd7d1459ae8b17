// See include/fsdp/plan/step_time.h.
#include <fsdp/plan/step_time.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <thread>

#include <fsdp/distributed/collectives.h>
#include <fsdp/plan/model_states.h>

#include "unit_bytes.h"

namespace fsdp::plan {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Forward and backward of one piece, the mean of `repeats` runs after a warm-up (the mean, not
// the fastest: a training step pays the allocator's and the caches' bad runs too).
PieceTime time_piece(const std::function<torch::Tensor()>& make_input,
                     const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                     int repeats) {
  PieceTime sum;
  for (int i = 0; i <= repeats; ++i) {
    torch::Tensor x = make_input();
    auto start = Clock::now();
    torch::Tensor y = forward(x);
    const double f = seconds_since(start);
    double b = 0;
    if (y.requires_grad()) {
      auto grad = torch::ones_like(y);
      start = Clock::now();
      y.backward(grad);
      b = seconds_since(start);
    }
    for (const auto& [name, p] : parameters)
      p.mutable_grad() = torch::Tensor();
    if (i > 0) {  // the first run warms caches and allocator pools
      sum.forward += f;
      sum.backward += b;
    }
  }
  return {sum.forward / repeats, sum.backward / repeats};
}

}  // namespace

ComputeTimes time_pieces(const CalibrationPieces& pieces, int64_t b, int64_t t, int repeats) {
  TORCH_CHECK(b >= 1 && t >= 1 && repeats >= 1, "fsdp::plan: timing at B=", b, ", T=", t);
  ComputeTimes out;
  auto hidden = [&] { return calibration_input(pieces, b, t); };
  out.pre = time_piece([] { return torch::Tensor(); },
                       [&](const torch::Tensor&) { return pieces.pre(b, t); }, pieces.parameters,
                       repeats);
  for (auto mode : {CheckpointMode::kNone, CheckpointMode::kFull, CheckpointMode::kSelective}) {
    out.block[static_cast<size_t>(mode)] = time_piece(
        hidden,
        [&](const torch::Tensor& x) {
          return fsdp::checkpoint(
              [&](const std::vector<torch::Tensor>& in) {
                return std::vector<torch::Tensor>{pieces.block(in[0], t)};
              },
              {x}, mode)[0];
        },
        pieces.parameters, repeats);
  }
  out.post = time_piece(
      hidden, [&](const torch::Tensor& x) { return pieces.loss(pieces.head(x, t), t); },
      pieces.parameters, repeats);
  return out;
}

double LinkCost::seconds(int64_t bytes, int64_t calls) const {
  if (bytes <= 0)
    return 0;
  return static_cast<double>(calls) * latency_s +
         (bytes_per_s > 0 ? static_cast<double>(bytes) / bytes_per_s : 0);
}

ComputeTimes time_pieces_together(
    const std::vector<std::shared_ptr<const CalibrationPieces>>& copies, int64_t b, int64_t t,
    int repeats) {
  TORCH_CHECK(!copies.empty(), "fsdp::plan: time_pieces_together needs pieces");
  if (copies.size() == 1)
    return time_pieces(*copies.front(), b, t, repeats);
  std::vector<ComputeTimes> times(copies.size());
  std::vector<std::exception_ptr> errors(copies.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < copies.size(); ++i) {
      threads.emplace_back([&, i] {
        try {
          times[i] = time_pieces(*copies[i], b, t, repeats);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
    }
    for (auto& th : threads)
      th.join();
  }
  for (const auto& e : errors) {
    if (e)
      std::rethrow_exception(e);
  }
  ComputeTimes mean;
  const double n = static_cast<double>(copies.size());
  auto add = [n](PieceTime& to, const PieceTime& from) {
    to.forward += from.forward / n;
    to.backward += from.backward / n;
  };
  for (const auto& c : times) {
    add(mean.pre, c.pre);
    add(mean.post, c.post);
    for (size_t m = 0; m < c.block.size(); ++m)
      add(mean.block[m], c.block[m]);
  }
  return mean;
}

LinkProfile measure_link(ProcessGroup& group, int64_t large_bytes, int repeats) {
  LinkProfile out;
  const int n = group.size();
  if (n <= 1)
    return out;
  TORCH_CHECK(large_bytes >= 4096 && repeats >= 1, "fsdp::plan: measure_link sizes");
  // Collectives run where the backend needs its tensors (the GPU of this rank for NCCL: the
  // current device).
  const torch::Device device(group.device_type());
  auto options = torch::TensorOptions().dtype(torch::kFloat).device(device);
  // The slowest rank's time of one collective: each rank times it, the maximum is taken.
  auto slowest = [&](double s) {
    auto t = torch::tensor({s}, torch::TensorOptions().dtype(torch::kDouble)).to(device);
    all_reduce(group, t, ReduceOp::kMax, "planner: link timing")->wait();
    return t.cpu().template item<double>();
  };
  auto median_of = [&](const std::function<void()>& op) {
    op();  // warm-up: connections, buffers
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
      barrier(group, "planner: link timing")->wait();
      const auto start = Clock::now();
      op();
      times.push_back(slowest(seconds_since(start)));
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  auto fit = [&](const std::function<void(int64_t)>& op) {
    // A line through three sizes (least squares), each the median of `repeats`: one noisy size
    // cannot make the bandwidth infinite or the latency negative.
    const std::array<double, 3> sizes{16384.0, static_cast<double>(large_bytes) / 4,
                                      static_cast<double>(large_bytes)};
    std::array<double, 3> times{};
    for (size_t i = 0; i < sizes.size(); ++i)
      times[i] = median_of([&] { op(static_cast<int64_t>(sizes[i])); });
    double mx = 0, my = 0;
    for (size_t i = 0; i < 3; ++i)
      mx += sizes[i] / 3, my += times[i] / 3;
    double sxy = 0, sxx = 0;
    for (size_t i = 0; i < 3; ++i) {
      sxy += (sizes[i] - mx) * (times[i] - my);
      sxx += (sizes[i] - mx) * (sizes[i] - mx);
    }
    LinkCost c;
    const double slope = sxy / sxx;
    if (slope > 0) {
      c.bytes_per_s = 1.0 / slope;
      c.latency_s = std::max(0.0, my - slope * mx);
    } else {  // no growth with size measured: all of it is latency at these sizes
      c.bytes_per_s = sizes[2] / times[2];
      c.latency_s = 0;
    }
    return c;
  };
  // Sizes as CommStats counts them: the gather's output, the reduce-scatter's input.
  out.all_gather = fit([&](int64_t bytes) {
    const int64_t per_rank = std::max<int64_t>(1, bytes / 4 / n);
    auto piece = torch::ones({per_rank}, options);
    auto whole = torch::empty({per_rank * n}, options);
    all_gather(group, {piece}, {whole}, 0, "planner: link timing")->wait();
  });
  out.reduce_scatter = fit([&](int64_t bytes) {
    const int64_t per_rank = std::max<int64_t>(1, bytes / 4 / n);
    auto whole = torch::ones({per_rank * n}, options);
    auto piece = torch::empty({per_rank}, options);
    reduce_scatter(group, whole, piece, ReduceOp::kAvg, "planner: link timing")->wait();
  });
  out.all_reduce = fit([&](int64_t bytes) {
    auto tensor = torch::ones({std::max<int64_t>(1, bytes / 4)}, options);
    all_reduce(group, tensor, ReduceOp::kAvg, "planner: link timing")->wait();
  });
  return out;
}

UnitTraffic unit_traffic(const UnitInfo& unit, const StepOptions& o, int rank) {
  const auto layout = detail::layout_of(o, rank);
  const auto b = detail::unit_bytes(unit, o, layout.geometry, layout.block_k, {}, {});
  UnitTraffic t;
  if (layout.geometry.n > 1) {
    t.gather_bytes = b.gathered > 0 ? b.gather_wire : 0;
    t.reduce_bytes = b.trainable ? b.reduce_input : 0;
  }
  return t;
}

double measure_comm_factor(ProcessGroup& group, const CalibrationPieces& pieces, int64_t b,
                           int64_t t, const UnitTraffic& traffic, const LinkProfile& link,
                           double compute_s, int repeats) {
  const int n = group.size();
  const double alone = link.all_gather.seconds(traffic.gather_bytes) +
                       link.reduce_scatter.seconds(traffic.reduce_bytes);
  if (n <= 1 || alone <= 0)
    return 1;
  const torch::Device device(group.device_type());
  auto options = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const int64_t gather_per_rank = std::max<int64_t>(1, traffic.gather_bytes / 4 / n);
  const int64_t reduce_per_rank = std::max<int64_t>(1, traffic.reduce_bytes / 4 / n);
  auto piece = torch::ones({gather_per_rank}, options);
  auto whole = torch::empty({gather_per_rank * n}, options);
  auto grads = torch::ones({reduce_per_rank * n}, options);
  auto shard = torch::empty({reduce_per_rank}, options);
  const torch::Tensor x = calibration_input(pieces, b, t);
  auto one = [&] {
    auto input = x.detach().requires_grad_(true);
    auto gather = all_gather(group, {piece}, {whole}, int64_t{4} << 20, "planner: overlap");
    auto reduce = reduce_scatter(group, grads, shard, ReduceOp::kAvg, "planner: overlap");
    auto y = pieces.block(input, t);
    y.backward(torch::ones_like(y));
    gather->wait();
    reduce->wait();
    for (const auto& [name, p] : pieces.parameters)
      p.mutable_grad() = torch::Tensor();
  };
  one();  // warm-up
  double total = 0;
  for (int i = 0; i < repeats; ++i) {
    barrier(group, "planner: overlap")->wait();
    const auto start = Clock::now();
    one();
    total += seconds_since(start);
  }
  // Every rank uses the slowest rank's figure, so all predict alike.
  auto mean =
      torch::tensor({total / repeats}, torch::TensorOptions().dtype(torch::kDouble)).to(device);
  all_reduce(group, mean, ReduceOp::kMax, "planner: overlap")->wait();
  const double both = mean.cpu().template item<double>();
  return std::max(0.0, both - compute_s) / alone;
}

namespace {

// Tensor parallelism's collectives over the step: every micro-batch runs each piece forward and
// backward, the blocks in their checkpoint modes; each collective costs its time alone.
void add_tp_traffic(const StepOptions& o, const TensorParallelTraffic& tp, const LinkProfile& link,
                    const std::function<CheckpointMode(size_t)>& mode, size_t n_blocks,
                    TimePrediction& out) {
  if (tp.ways <= 1)
    return;
  CommStats per_micro_batch;
  auto add = [&](const PieceTraffic& piece) {
    per_micro_batch += piece.forward;
    per_micro_batch += piece.backward;
  };
  add(tp.pre);
  add(tp.post);
  for (size_t i = 0; i < n_blocks; ++i)
    add(tp.block_with(mode(i)));
  for (int mb = 0; mb < o.micro_batches; ++mb)
    out.tp_traffic += per_micro_batch;
  const auto& c = out.tp_traffic;
  out.tp_bytes = buffer_bytes(c);
  out.tp_calls = c.all_reduce.calls + c.all_gather.calls + c.reduce_scatter.calls;
  out.tp_s = link.all_reduce.seconds(c.all_reduce.bytes, c.all_reduce.calls) +
             link.all_gather.seconds(c.all_gather.bytes, c.all_gather.calls) +
             link.reduce_scatter.seconds(c.reduce_scatter.bytes, c.reduce_scatter.calls);
}

}  // namespace

TimePrediction predict_step_time(const std::vector<UnitInfo>& units, const StepOptions& o,
                                 const TimeInputs& in, int rank) {
  TORCH_CHECK(!units.empty() && units.back().path.empty(),
              "fsdp::plan: the units must be the blocks, then the root (\"\")");
  const auto layout = detail::layout_of(o, rank);
  const auto& g = layout.geometry;
  const size_t n_blocks = units.size() - 1, root = n_blocks;
  const int world = o.states.world_size;
  const int replicas = world / g.n;
  TimePrediction out;
  const double factor = std::max(0.0, in.comm_factor);
  const auto mode = [&](size_t u) {
    return u < o.checkpoint.size() ? o.checkpoint[u] : CheckpointMode::kNone;
  };
  std::vector<detail::UnitBytes> bytes;
  for (size_t u = 0; u < units.size(); ++u)
    bytes.push_back(
        detail::unit_bytes(units[u], o, g, u == root ? std::nullopt : layout.block_k, {}, {}));
  for (int mb = 0; mb < o.micro_batches; ++mb) {
    const bool sync = o.sync_every_micro_batch || mb == o.micro_batches - 1;
    // Compute: the pieces in the order they run.
    out.forward_s += in.compute.pre.forward + in.compute.post.forward;
    out.backward_s += in.compute.pre.backward + in.compute.post.backward;
    for (size_t i = 0; i < n_blocks; ++i) {
      const auto& t = in.compute.block[static_cast<size_t>(mode(i))];
      out.forward_s += t.forward;
      out.backward_s += t.backward;
      if (mode(i) != CheckpointMode::kNone) {
        out.recompute_s += std::max(
            0.0,
            t.backward - in.compute.block[static_cast<size_t>(CheckpointMode::kNone)].backward);
      }
    }
    // Traffic, unit by unit: the gathers (the root once, a block twice when it reshards after
    // forward), the reduce-scatter of its gradients, the all-reduce across replicas. Each
    // collective's seconds are what it adds: comm_factor times its time alone, or with
    // overlap what exceeds a unit's compute in the same phase.
    for (size_t u = 0; u < units.size(); ++u) {
      const auto& b = bytes[u];
      out.overhead_s += in.overhead.seconds(static_cast<int64_t>(units[u].params.size()));
      const PieceTime own = u == root
                                ? PieceTime{in.compute.pre.forward + in.compute.post.forward,
                                            in.compute.pre.backward + in.compute.post.backward}
                                : in.compute.block[static_cast<size_t>(mode(u))];
      double forward_room = own.forward, backward_room = own.backward;
      auto exposed = [&](double seconds, bool backward) {
        if (!in.overlap)
          return factor * seconds;
        double& room = backward ? backward_room : forward_room;
        const double hidden = std::min(room, seconds);
        room -= hidden;
        return seconds - hidden;
      };
      if (g.n > 1 && b.gathered > 0) {
        const int gathers = u == root || !layout.blocks_reshard ? 1 : 2;
        // Gloo carries a gather in calls of at most all_gather_bucket_bytes.
        const int64_t calls =
            o.gloo_staging && o.all_gather_bucket_bytes > 0
                ? std::max<int64_t>(1, detail::ceil_div(b.gather_wire, o.all_gather_bucket_bytes))
                : 1;
        out.all_gather_bytes += b.gather_wire;  // forward
        out.all_gather_calls += 1;
        out.all_gather_exposed_s +=
            exposed(in.shard.all_gather.seconds(b.gather_wire, calls), false);
        if (gathers == 2) {
          // Backward: from a kept block (reshard-to-k) the unit travels in the compute dtype.
          const int64_t bytes = layout.block_k ? b.gathered : b.gather_wire;
          out.all_gather_bytes += bytes;
          out.all_gather_calls += 1;
          out.all_gather_exposed_s += exposed(in.shard.all_gather.seconds(bytes, calls), true);
        }
      }
      if (!b.trainable || !sync)
        continue;
      if (g.n > 1) {
        out.reduce_scatter_bytes += b.reduce_input;
        out.reduce_exposed_s += exposed(in.shard.reduce_scatter.seconds(b.reduce_input), true);
      }
      if (replicas > 1) {
        const int64_t bytes = g.n > 1 ? b.reduce_output : b.reduce_input;
        // Gloo all-reduces in buckets of all_reduce_bucket_bytes (FullyShardOptions).
        out.all_reduce_bytes += bytes;
        out.reduce_exposed_s += exposed(in.replicate.all_reduce.seconds(bytes), true);
      }
    }
  }
  add_tp_traffic(o, in.tp_traffic, in.tp, mode, n_blocks, out);
  out.optimizer_s = in.optimizer_s;
  // Offload I/O. CPU offload: the parameter shards go to the device for each gather (twice for
  // blocks that reshard after forward; the root's once, counted alike: a small overestimate),
  // the gradient shards come back after each reduction.
  if (o.states.cpu_offload && in.host_bytes_per_s > 0) {
    const auto states = model_states(units, o.states, rank);
    const int gathers = layout.blocks_reshard ? 2 : 1;
    const int reductions = o.sync_every_micro_batch ? o.micro_batches : 1;
    const int64_t bytes = states.params * gathers * o.micro_batches + states.grads * reductions;
    out.offload_bytes += bytes;
    out.offload_s += static_cast<double>(bytes) / in.host_bytes_per_s;
  }
  if (o.states.optimizer_in_file && in.disk_read_bytes_per_s > 0 && in.disk_write_bytes_per_s > 0) {
    auto resident = o.states;
    resident.optimizer_in_file = false;
    const int64_t bytes = model_states(units, resident, rank).optimizer;
    out.offload_bytes += 2 * bytes;
    out.offload_s += static_cast<double>(bytes) / in.disk_read_bytes_per_s +
                     static_cast<double>(bytes) / in.disk_write_bytes_per_s;
  }
  out.step_s = out.forward_s + out.backward_s + out.all_gather_exposed_s + out.reduce_exposed_s +
               out.optimizer_s + out.offload_s + out.overhead_s + out.tp_s;
  return out;
}

}  // namespace fsdp::plan
