"""PyTorch's own 2-D composition of a Llama, for tests/test_tensor_parallel.cpp to compare with.

Run under torchrun, or with the environment it sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
the test starts its ranks so, as forks of its Python server), on CPU (Gloo): a (dp, tp) mesh from init_device_mesh, torchtitan's plan
(parallelize_module with ColwiseParallel / RowwiseParallel on the tp axis, the embedding and
the head split by words, the cross-entropy under loss_parallel), then fully_shard on the dp
axis. It starts from the weights the C++ side wrote (init.safetensors, fsdp-cpp's parameter
names), trains on its batches (tokens.bin: int64 [steps, batch, seq + 1]) with the same AdamW
and clipping, and writes each step's loss, the mean over the data-parallel ranks, one per line.

  torchrun --nproc-per-node 4 check_tp.py DIR --tp 2 --dim 48 --heads 4 --kv-heads 2 ...
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

# The benchmark's PyTorch mirror of fsdp-cpp's norm and rotary embedding (bench/torch_gpt.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from torch_gpt import RMSNorm, apply_rotary, rope_tables  # noqa: E402


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.hd = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        # -1: the heads this rank holds once the projections are split (as torchtitan's).
        q = apply_rotary(self.wq(x).view(b, t, -1, self.hd), cos, sin)
        k = apply_rotary(self.wk(x).view(b, t, -1, self.hd), cos, sin)
        v = self.wv(x).view(b, t, -1, self.hd)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=q.size(2) != k.size(2))
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = Attention(a.dim, a.heads, a.kv_heads)
        self.feed_forward = FeedForward(a.dim, a.ffn)
        self.attention_norm = RMSNorm(a.dim, a.eps)
        self.ffn_norm = RMSNorm(a.dim, a.eps)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """fsdp-cpp's Llama (models/llama.h), untied, with its parameter names."""

    def __init__(self, a):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim, a.eps)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, idx):
        cos, sin = rope_tables(idx.size(1), self.a.dim // self.a.heads, self.a.theta, idx.device)
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.output(self.norm(x))


def clip(model, max_norm):
    """torch.nn.utils.clip_grad_norm_ over parameters on two meshes (the split ones on (dp, tp),
    the norms on dp alone), which it refuses to stack: each parameter's norm made whole, then
    the same coefficient as clip_grad_norm_'s."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = sum(float(g.norm(2).full_tensor() if isinstance(g, DTensor) else g.norm(2)) ** 2
                for g in grads) ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--tp", type=int, required=True)
    for name in ("vocab", "dim", "layers", "heads", "kv-heads", "ffn"):
        p.add_argument("--" + name, type=int, required=True)
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--theta", type=float, default=10000.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-eps", type=float, default=1e-6)
    p.add_argument("--max-norm", type=float, default=0.5)
    a = p.parse_args()
    torch.set_num_threads(1)
    # Gloo's event-loop threads spin while a sending thread holds their connection's lock, and
    # preempt it when woken; fsdp-cpp creates them under SCHED_BATCH
    # (src/distributed/gloo_loop_policy.h), and so does this reference (threads inherit the
    # policy): its 4 ranks on 2 cores take seconds less, with the same arithmetic.
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]

    model = Llama(a)
    model.load_state_dict(load_file(os.path.join(a.dir, "init.safetensors")), strict=True)
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                  use_local_output=False),
    })
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                            eps=a.adam_eps)

    tokens = np.fromfile(os.path.join(a.dir, "tokens.bin"), dtype=np.int64)
    meta = json.load(open(os.path.join(a.dir, "tokens.json")))
    tokens = torch.from_numpy(tokens.reshape(meta["steps"], meta["batch"], meta["seq"] + 1))
    per_rank = meta["batch"] // dp.size()
    first = dp.get_local_rank() * per_rank
    losses = []
    for step in range(meta["steps"]):
        batch = tokens[step, first:first + per_rank]
        x, y = batch[:, :-1], batch[:, 1:]
        opt.zero_grad()
        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        clip(model, a.max_norm)
        opt.step()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        mean = value.detach().clone().reshape(1)
        dist.all_reduce(mean, group=dp.get_group())
        losses.append(mean.item() / dp.size())
    if dist.get_rank() == 0:
        with open(os.path.join(a.dir, "torch_losses.txt"), "w") as f:
            f.write("".join(f"{v:.9g}\n" for v in losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
