// Tensor parallelism for the model zoo (Megatron-LM's layout), applied from outside as
// parallelize_gpt applies FSDP: each function splits an already initialised model's layers
// over a tensor-parallel group, keeping this rank's part of each, and the layers' forwards add
// the communication (fsdp/tensor_parallel/tp_ops.h).
//
// Per block: attention split by heads (q, k and v column-parallel, keeping this rank's heads;
// the output projection row-parallel), the MLP split on its hidden dimension (its first
// Linear(s) column-parallel, the last row-parallel): one all-reduce in forward and one in
// backward for each of the two (Llama's separate q, k, v and w1, w3 share one copy of their
// input, so one all-reduce of its gradient each, as Megatron's fused layers; not where LoRA
// adapters sit on them: one each then). The token embedding and the head are split by words
// (fsdp/tensor_parallel/vocab_parallel.h): forward(tokens) gathers the whole logits, and the
// loss forward (forward(tokens, LossSpec)) computes the cross-entropy from this rank's words
// without gathering them. Norms, GPT's position embedding and the row-parallel Linears' biases
// are kept whole on every rank: they see the same inputs and get the same gradients on every
// rank, so they stay equal without communication.
//
// With sequence parallelism (model->use_sequence_parallel(tp) after the split), the residual
// stream between the split layers holds each rank's 1/tp of the positions instead of all of
// them: the two all-reduces of a block become an all-gather before its column-parallel layers
// and a reduce-scatter after its row-parallel ones (the same bytes), and the norms, the residual
// adds and the embeddings compute on 1/tp of the positions (their weights' gradients summed
// over the group). Not with LoRA adapters or Llama kv heads kept whole yet.
//
// Then fully_shard each block over the data-parallel group (fsdp::DeviceMesh2D::dp): FSDP
// shards each rank's parts as it shards any parameter. Each function returns where this rank's
// part of every split parameter sits in the whole model (fsdp::TensorParallelLayout, names as
// the model's named_parameters()): fsdp::save_sharded stores whole tensors with it, and
// fsdp::load_sharded reads a checkpoint of any (dp, tp) mesh into this one.
//
// Requirements, checked: the heads divide by the group's size (GPT n_head, Llama n_heads);
// Llama's key/value heads are split when n_kv_heads divides by it, and otherwise kept whole on
// every rank (each rank computing all of them and using those its query heads read, their
// gradient summed over the group), which needs tp divisible by n_kv_heads; Llama's
// ffn_hidden_dim divides by it. LoRA adapters added before are split with their weights
// (LinearImpl::split_output_features). A model built on the meta device splits too, and then
// fills its shards with tensor_parallel_initializer(). Not yet: NF4 storage on split layers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <fsdp/checkpoint/tensor_parallel_layout.h>
#include <fsdp/clip_grad.h>
#include <fsdp/distributed/process_group.h>

#include "gpt.h"
#include "llama.h"

namespace fsdp_models {

fsdp::TensorParallelLayout tensor_parallelize_gpt(GPT& model,
                                                  const std::shared_ptr<fsdp::ProcessGroup>& tp);
fsdp::TensorParallelLayout tensor_parallelize_llama(Llama& model,
                                                    const std::shared_ptr<fsdp::ProcessGroup>& tp);

/// A FullyShardOptions::param_init for a model split on the meta device (tensor_parallelize_*
/// on a model built with ModelInit().device(torch::kMeta), then to_hollow()): each rank fills
/// its FSDP rows of its part of each parameter with the values init_parameter() gives the whole
/// tensor there (under `scheme` and `seed`), so a model split over any (dp, tp) starts as the same
/// model built whole. Build it after to_hollow() and before fully_shard().
std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>
tensor_parallel_initializer(torch::nn::Module& model, InitScheme scheme, uint64_t seed,
                            fsdp::TensorParallelLayout layout);

/// What fsdp::clip_grad_norm_ needs to count the norm over both axes: the parameters these
/// functions split (a different part on each rank), and the group's size.
fsdp::TensorParallelParams tensor_parallel_params(torch::nn::Module& model, int ways);

}  // namespace fsdp_models
