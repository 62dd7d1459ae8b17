"""The PyTorch side of bench/vs_pytorch.py: fsdp-train's GPT training step, in Python.

One process per rank (torchrun, or bench/emulated_link.sh's RANK/WORLD_SIZE variables), Gloo,
CPU. Everything the step computes mirrors fsdp-train, so that the two can be compared loss for
loss and second for second:
  - the model is models/gpt.cpp (learned positions, pre-LayerNorm blocks, GELU tanh MLP, causal
    scaled_dot_product_attention, tied embeddings), loaded from the Hugging Face directory the
    driver writes once (fsdp-train reads the same file through model.init_from);
  - the batches are trainer/data/data.cpp's DistributedSampler, reimplemented below bit for bit
    (std::mt19937_64, the same rejection draw and Fisher-Yates), reading the same train.bin;
  - the step is trainer.cpp's: AdamW with decay on matrices only, warm-up then cosine learning
    rate, global gradient-norm clipping, mean cross-entropy.

  --mode fsdp2   torch.distributed.fsdp.fully_shard on every block, then on the root
  --mode ddp     torch.nn.parallel.DistributedDataParallel
  --mode single  the plain model in one process (the compute reference)

Each rank writes one JSON line per step to --out.<rank> (loss, step time) and a summary line
(RSS, VmHWM) at the end. Step time is what fsdp-train's is: from fetching the batch to the end
of the optimizer step, the loss's .item() included, the cross-rank loss average excluded.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

M64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64, which the C++ standard specifies bit for bit."""

    N, M = 312, 156

    def __init__(self, seed):
        mt = [seed & M64]
        for i in range(1, self.N):
            mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & M64)
        self.mt, self.index = mt, self.N

    def _twist(self):
        mt, n, m = self.mt, self.N, self.M
        for i in range(n):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % n] & 0x7FFFFFFF)
            mt[i] = mt[(i + m) % n] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
        self.index = 0

    def __call__(self):
        if self.index >= self.N:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & M64


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def uniform_below(gen, n):
    threshold = ((1 << 64) - n) % n
    while True:
        r = gen()
        if r >= threshold:
            return r % n


def read_token_file(path):
    """trainer/data/data.h's token file: a 64-byte header, then uint16 or uint32 tokens."""
    with open(path, "rb") as f:
        header = f.read(64)
    if len(header) != 64 or header[:8] != b"FSDPTOK1":
        sys.exit(f"{path}: not an fsdp-train token file")
    width = int.from_bytes(header[12:16], "little")
    count = int.from_bytes(header[16:24], "little")
    if width not in (2, 4) or os.path.getsize(path) != 64 + count * width:
        sys.exit(f"{path}: bad header or truncated")
    return np.memmap(path, dtype=np.uint16 if width == 2 else np.uint32, mode="r", offset=64,
                     shape=(count,))


class DistributedSampler:
    """trainer/data/data.cpp's DistributedSampler, window for window."""

    def __init__(self, tokens, batch, seq_len, rank, world, seed):
        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.rank, self.world, self.seed = rank, world, seed
        self._start_epoch(0)

    def _start_epoch(self, epoch):
        w = self.seq_len + 1
        gen = MT19937_64(splitmix64(self.seed) ^ splitmix64((epoch * 2 + 1) & M64))
        self.phase = uniform_below(gen, w)
        order = list(range((len(self.tokens) - self.phase) // w))
        for i in range(len(order), 1, -1):
            j = uniform_below(gen, i)
            order[i - 1], order[j] = order[j], order[i - 1]
        self.order, self.epoch, self.position = order, epoch, 0

    def next(self):
        if self.position + self.batch * self.world > len(self.order):
            self._start_epoch(self.epoch + 1)
        w = self.seq_len + 1
        first = self.position + self.rank * self.batch
        rows = [self.tokens[self.phase + self.order[first + b] * w:][:w]
                for b in range(self.batch)]
        self.position += self.batch * self.world
        return torch.from_numpy(np.stack(rows).astype(np.int64))


class Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        heads = lambda y: y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.wpe = nn.Embedding(cfg["n_positions"], cfg["n_embd"])
        self.h = nn.ModuleList(Block(cfg["n_embd"], cfg["n_head"]) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(cfg["n_embd"])

    def forward(self, idx):
        pos = torch.arange(idx.size(1))
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head


def load_gpt(hf_dir):
    """GPT from a GPT-2 Hugging Face directory (Conv1D weights are stored (in, out))."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    model = GPT(cfg)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.startswith("lm_head.") or name.endswith(".attn.bias") or \
                name.endswith(".attn.masked_bias"):
            continue
        key = name.removeprefix("transformer.")
        if key.endswith(".weight") and any(s in key for s in ("c_attn", "c_proj", "c_fc")):
            t = t.t()
        state[key] = t.contiguous().float()
    model.load_state_dict(state, strict=True)
    return model, cfg


def save_gpt(hf_dir, vocab_size, block_size, n_layer, n_head, n_embd, seed, init_std=0.02):
    """Writes a freshly initialised GPT (GPT-2's scheme: N(0, init_std) weights, the residual
    projections N(0, init_std / sqrt(2 n_layer)), zero biases, unit LayerNorms) as the
    Hugging Face GPT-2 directory both sides start from."""
    from safetensors.torch import save_file
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
           "n_positions": block_size, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head,
           "n_inner": None, "activation_function": "gelu_pytorch_tanh",
           "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
           "attn_pdrop": 0.0, "scale_attn_weights": True, "initializer_range": init_std,
           "tie_word_embeddings": True, "torch_dtype": "float32"}
    torch.manual_seed(seed)
    model = GPT(cfg)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("bias"):
            t = torch.zeros_like(t)
        elif ".ln_" in "." + name:  # LayerNorm weights
            t = torch.ones_like(t)
        elif name.endswith("c_proj.weight"):
            t = torch.randn(t.shape) * (init_std / math.sqrt(2 * n_layer))
        else:
            t = torch.randn(t.shape) * init_std
        if any(s in name for s in ("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t()  # Conv1D: (in, out)
        tensors["transformer." + name] = t.contiguous()
    os.makedirs(hf_dir, exist_ok=True)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def learning_rate(step, a):
    if step <= a.warmup_steps:
        return a.lr * step / max(1, a.warmup_steps)
    progress = (step - a.warmup_steps) / max(1, a.steps - a.warmup_steps)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def proc_status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("fsdp2", "ddp", "single"), required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--train-bin", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    a = p.parse_args()

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if a.mode != "single":
        dist.init_process_group("gloo")
    elif world != 1:
        sys.exit("--mode single runs one process")

    model, _ = load_gpt(a.hf_dir)
    if a.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    elif a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    params = [q for q in model.parameters() if q.requires_grad]
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    # The fastest AdamW torch has on CPU: fused where it supports the parameters (plain
    # tensors; DTensors too in recent torch), else foreach.
    try:
        optimizer = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), fused=True)
        fused = True
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), foreach=True)
        fused = False

    sampler = DistributedSampler(read_token_file(a.train_bin), a.batch, a.seq_len, rank, world,
                                 a.seed)
    out = open(f"{a.out}.{rank}", "w")
    for step in range(1, a.steps + 1):
        lr = learning_rate(step, a)
        for g in optimizer.param_groups:
            g["lr"] = lr
        start = time.perf_counter()
        xy = sampler.next()
        optimizer.zero_grad(set_to_none=True)
        logits = model(xy[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), xy[:, 1:].reshape(-1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, a.grad_clip) if a.grad_clip > 0 \
            else torch.zeros(())
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        local_loss = loss.item()
        step_s = time.perf_counter() - start
        mean = torch.tensor([local_loss], dtype=torch.float64)
        if a.mode != "single":
            dist.all_reduce(mean)
        out.write(json.dumps({"step": step, "loss": mean.item() / world, "step_time_s": step_s,
                              "grad_norm": float(grad_norm),
                              "rss_bytes": proc_status_bytes("VmRSS")}) + "\n")
    out.write(json.dumps({"summary": True, "fused_adamw": fused,
                          "peak_rss_bytes": proc_status_bytes("VmHWM"),
                          "rss_bytes": proc_status_bytes("VmRSS")}) + "\n")
    out.close()
    if a.mode != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
