// fsdp.fault_tolerant: the Trainer's loop when replicas drop out and come back. The protocol
// (vote, reform, admit, the schedule) is ReplicaMembership's; here is what a change means for
// the training state: the units' cross-replica group, the figures' group and writer, and the
// state a joining replica copies (shards, optimizer state, data position, previous norm, loss
// scale).
#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>

#include <fsdp/core/trace.h>
#include <fsdp/fully_shard.h>
#include <fsdp/optim/fused_optimizer.h>

#include "trainer.h"

namespace fsdp_trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Each attempt of a step draws its random numbers (LoRA's dropout) from a seed of the step and
// the rank alone: a replica that comes back (a new process, or one the schedule kept waiting)
// and an attempt run again draw what the reference run of the schedule draws.
void seed_attempt(int64_t seed, int rank, int64_t step) {
  uint64_t z = static_cast<uint64_t>(seed) ^ (static_cast<uint64_t>(rank) << 40) ^
               static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull;
  // SplitMix64's finaliser: nearby (rank, step) pairs get unrelated seeds.
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(z);
}

}  // namespace

bool Trainer::speaks() const {
  return membership_ ? membership_->writer() : pg_->rank() == 0;
}

fsdp::ProcessGroup& Trainer::norm_group() {
  return membership_ ? *membership_->quorum().replica_group() : *pg_;
}

void Trainer::on_membership_change(int64_t step) {
  auto& quorum = membership_->quorum();
  // Counted until now on the old groups, from now on on the new ones (which start at zero).
  profiler_->groups_changing();
  fsdp::set_replicate_group(*model_.module, quorum.replicate_group());
  fsdp::set_shard_group(*model_.module, quorum.replica_group());
  profiler_->groups_changed();
  if (auto* scaler = optimizers_->scaler())  // its inf check is over the replica's shards
    scaler->set_group(quorum.replica_group());
  metrics_pg_ = quorum.live_group();
  metrics_->set_group(metrics_pg_);
  // The lowest live rank writes: a new writer continues metrics.jsonl after the last step
  // logged before the change, as a resumed run does.
  const bool writer = membership_->writer();
  if (writer && !metrics_->has_outputs())
    metrics_->open_outputs(config_.logging, config_.training.steps, step - 1);
  else if (!writer && metrics_->has_outputs())
    metrics_->close_outputs();
}

void Trainer::sync_replica_state(bool joining) {
  torch::NoGradGuard no_grad;
  // What training changes is copied; the frozen weights of fine-tuning are read from the model
  // file by every replica, and only compared (a file changed since the job began would leave
  // a joining replica training on another base).
  std::vector<torch::Tensor> shards, frozen;
  for (const auto& p : model_.module->parameters())
    (p.requires_grad() ? shards : frozen).push_back(p.detach());
  auto& o = *optimizers_;
  // A fused optimizer's state goes as tensors (its moments, a joining rank's zeros until
  // received, and every parameter's step count); torch's optimizers' in their archive.
  auto* fused = dynamic_cast<fsdp::FusedOptimizer*>(&o.optimizer());
  std::vector<std::map<std::string, torch::Tensor>> moments;
  torch::Tensor steps;
  if (fused) {
    const auto& params = o.params();
    steps = torch::zeros({static_cast<int64_t>(params.size())}, torch::kLong);
    for (size_t i = 0; i < params.size(); ++i) {
      int64_t step = 0;
      if (!joining)
        fused->get_state_step(params[i], &step);
      steps.data_ptr<int64_t>()[i] = step;
      auto& state = moments.emplace_back();
      for (const auto& name : fused->state_names()) {
        auto t = step > 0 ? fused->state_tensor(params[i], name).contiguous().clone()
                          : torch::zeros(
                                params[i].sizes(),
                                params[i].options().dtype(fused->state_options().moments_dtype()));
        state[name] = t;
        shards.push_back(t);
      }
    }
    shards.push_back(steps);
  }
  // What else a replica holds alike, in one blob: torch's optimizer state, the sampler's
  // position and the previous step's gradient norm.
  torch::serialize::OutputArchive out, optimizer;
  if (!fused)
    o.optimizer().save(optimizer);
  out.write("optimizer", optimizer);
  const SamplerState sampler = data_->state();
  out.write("sampler.epoch", c10::IValue(sampler.epoch));
  out.write("sampler.position", c10::IValue(sampler.position));
  out.write("sampler.seed", c10::IValue(static_cast<int64_t>(sampler.seed)));
  out.write("previous_grad_norm", c10::IValue(o.previous_grad_norm()));
  // The loss scale: every replica's gradients are scaled alike before they are averaged.
  const auto scaler = o.scaler() ? o.scaler()->state() : fsdp::ShardedGradScaler::State{};
  out.write("scaler.scale", c10::IValue(scaler.scale));
  out.write("scaler.growth_tracker", c10::IValue(scaler.growth_tracker));
  out.write("scaler.skipped_steps", c10::IValue(scaler.skipped_steps));
  out.write("answers_before", c10::IValue(c10::List<std::string>(answers_before_)));
  std::ostringstream os;
  out.save_to(os);
  std::string blob = os.str();
  membership_->quorum().sync_state(shards, &blob, frozen);
  if (!joining)  // its own state, checked equal to the sender's
    return;
  std::istringstream is(blob);
  torch::serialize::InputArchive in, optimizer_in;
  in.load_from(is);
  in.read("optimizer", optimizer_in);
  if (fused) {
    const auto& params = o.params();
    for (size_t i = 0; i < params.size(); ++i)
      fused->set_state(params[i], moments[i], steps.data_ptr<int64_t>()[i]);
  } else {
    o.optimizer().load(optimizer_in);
  }
  c10::IValue v;
  SamplerState state;
  in.read("sampler.epoch", v);
  state.epoch = v.toInt();
  in.read("sampler.position", v);
  state.position = v.toInt();
  in.read("sampler.seed", v);
  state.seed = static_cast<uint64_t>(v.toInt());
  data_->load_state(state);
  in.read("previous_grad_norm", v);
  o.previous_grad_norm() = v.toDouble();
  if (o.scaler()) {
    fsdp::ShardedGradScaler::State received;
    in.read("scaler.scale", v);
    received.scale = v.toDouble();
    in.read("scaler.growth_tracker", v);
    received.growth_tracker = v.toInt();
    in.read("scaler.skipped_steps", v);
    received.skipped_steps = v.toInt();
    o.scaler()->load_state(received);
  }
  in.read("answers_before", v);
  answers_before_.clear();
  for (const auto& answer : v.toListRef())
    answers_before_.push_back(answer.toStringRef());
}

void Trainer::save_checkpoint_fault_tolerant(int64_t step) {
  try {
    save_checkpoint(step);
  } catch (const std::exception& e) {
    // Every live rank was in the save's collectives: one that failed (a peer died, or a peer's
    // write failed and it left them) fails them all, so all of them get here and reform. A
    // fault after the commit (in the last barrier) leaves the checkpoint complete.
    const bool complete = std::filesystem::exists(std::filesystem::path(checkpoint_dir(config_)) /
                                                  step_dir_name(step) / "index.json");
    std::fprintf(stderr, "fsdp-train: [rank %d] the checkpoint of step %lld %s: %s\n", pg_->rank(),
                 static_cast<long long>(step),
                 complete ? "was written, but a rank failed at its end"
                          : "failed (the previous one stays the latest)",
                 first_line(e).c_str());
    membership_->groups_failed();
  }
}

StepMetrics Trainer::fault_tolerant_step(int64_t step) {
  const auto& t = config_.training;
  StepMetrics m;
  const Batch batch = begin_step(step, m);  // once: a failed attempt runs the same batch again
  auto& o = *optimizers_;
  const StepParts parts{model_,     o.optimizer(), o.params(),
                        *profiler_, o.scaler(),    o.previous_grad_norm()};
  const bool previous_clip = t.grad_clip > 0 && t.grad_clip_mode == "previous_step";
  const PreviousNormClip clip{previous_clip ? t.grad_clip : 0.0, parts.previous_grad_norm};
  double loss_sum = 0, loss_mean = 0;
  // The live replicas vote on each attempt; the update comes after the step is committed, so
  // a failed attempt leaves nothing to undo but the gradients. The loss's mean over the live
  // ranks is part of the attempt: a step's loss is always that of the replicas that committed
  // it, as in the schedule's reference run.
  membership_->commit(step, [&] {
    try {
      seed_attempt(t.seed, pg_->rank(), step);
      parts.optimizer.zero_grad();
      loss_sum = backward_passes(parts, batch, nullptr);
      loss_mean = metrics_->mean(loss_sum);
      return true;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fsdp-train: [rank %d] step %lld failed: %s\n", pg_->rank(),
                   static_cast<long long>(step), first_line(e).c_str());
      return false;
    }
  });
  try {
    optimizer_phase(parts, nullptr, clip, m);
  } catch (const std::exception& e) {
    // The norm is summed within this replica: a rank of it failed after the others committed,
    // so this replica's update is incomplete and it leaves; the others drop it next step.
    throw LeftTheJob(
        fmt::format("rank {}: the update of step {} failed: {}", pg_->rank(), step, first_line(e)));
  }
  end_step(step, batch, m);
  fsdp::trace::Span span("metrics", "metrics");
  std::optional<double> local_tokens;
  // An estimate if the reduction below fails; fine-tuning's batches are padded to their own
  // longest conversation, so its count is the reduction's.
  m.tokens = data_->tokens_in(batch) * metrics_pg_->size();
  if (data_->finetune())
    local_tokens = static_cast<double>(data_->tokens_in(batch));
  try {
    metrics_->reduce(m, loss_sum, local_tokens);
  } catch (const std::exception& e) {
    // A replica failed since the commit: the next step drops it; this line lacks the other
    // ranks' memory and time figures.
    std::fprintf(stderr, "fsdp-train: [rank %d] step %lld's figures over the replicas failed: %s\n",
                 pg_->rank(), static_cast<long long>(step), first_line(e).c_str());
  }
  m.loss = loss_mean;
  return m;
}

void Trainer::train_fault_tolerant() {
  const auto& t = config_.training;
  const int64_t every = config_.checkpoint.every;
  int64_t first = start_step_ + 1;
  std::optional<double> initial_eval;
  const bool joined = membership_->joining();  // restarted, or a spare
  if (joined) {
    first = membership_->join();
    if (first == fsdp::ReplicaQuorum::kFinished) {
      std::printf("fsdp-train: [rank %d] training ended without needing spare replica %d\n",
                  pg_->rank(), membership_->quorum().replica());
      return;
    }
  } else {
    membership_->start(first);
    if (data_->finetune())
      answers_before_ = answer_questions();
    initial_eval = evaluate();
    metrics_->message(fmt::format("step {}: held-out loss {:.4f}", start_step_, *initial_eval));
  }
  std::optional<double> last_eval_loss;
  const auto start = Clock::now();
  int64_t steps_run = 0;
  // The step this replica was admitted at: the change there is made already.
  int64_t joined_at = joined ? first : -1;
  for (int64_t step = first; step <= t.steps; ++step) {
    if (step != joined_at) {
      membership_->before_step(step);
      if (membership_->resume_step() > step) {  // dropped by the schedule, and back
        joined_at = membership_->resume_step();
        step = joined_at - 1;
        continue;
      }
    }
    auto m = fault_tolerant_step(step);
    const bool eval_now = step == t.steps || (t.eval_every > 0 && step % t.eval_every == 0);
    if (eval_now) {
      try {
        m.eval_loss = evaluate();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fsdp-train: [rank %d] evaluation after step %lld failed: %s\n",
                     pg_->rank(), static_cast<long long>(step), first_line(e).c_str());
      }
    }
    ++steps_run;
    if (m.eval_loss)
      last_eval_loss = m.eval_loss;
    if (speaks()) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      metrics_->log(m,
                    elapsed / static_cast<double>(steps_run) * static_cast<double>(t.steps - step));
      if (m.eval_loss) {
        metrics_->message(fmt::format("step {}: held-out loss {:.4f} (train {:.4f})", step,
                                      *m.eval_loss, m.loss));
      }
    }
    if (!std::isfinite(m.loss))
      throw std::runtime_error(fmt::format("loss is {} at step {}", m.loss, step));
    // By the replicas that committed the step, before a joining one is admitted.
    if (every > 0 && (step % every == 0 || step == t.steps))
      save_checkpoint_fault_tolerant(step);
    if (step < t.steps)  // none is admitted after the last: finish() tells them it is over
      membership_->after_step(step);
  }
  // Before the outputs, which take long enough for a replica waiting to join to give up: spares
  // never needed and restarted replicas not admitted stop waiting.
  membership_->finish();
  finish_async_save();
  report_plan();
  // By the live replicas; a fault in it fails it (the checkpoints stay) and the job with it.
  if (config_.checkpoint.export_hf)
    export_hf(export_dir(config_), /*replace=*/true);
  if (data_->finetune())
    write_finetune_outputs(answers_before_, answer_questions());
  if (!speaks())
    return;
  metrics_->finish();
  if (last_eval_loss) {
    if (initial_eval)
      std::printf("held-out loss: %.4f -> %.4f\n", *initial_eval, *last_eval_loss);
    else
      std::printf("held-out loss: %.4f\n", *last_eval_loss);
  }
  write_outputs();
}

}  // namespace fsdp_trainer
