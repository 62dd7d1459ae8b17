"""The PyTorch side of bench/vs_pytorch.py and bench/gpu_check.py: fsdp-train's training step,
in Python.

One process per rank (torchrun, or bench/emulated_link.sh's RANK/WORLD_SIZE variables): Gloo on
the CPU, or NCCL with --device cuda (GPU LOCAL_RANK). Everything the step computes mirrors
fsdp-train, so that the two can be compared loss for loss and second for second:
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

  --param-dtype bf16   MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on every
                       block and on the root, whose output (the logits) is fp32: fsdp-train's
                       precision.param_dtype = "bf16"
  --ac                 every block in checkpoint_wrapper (recomputed in backward):
                       fsdp.activation_checkpointing = "full"
  --init random        no Hugging Face directory: a model of --arch's shape (--n-layer ...)
                       built on the device with random weights, for speed runs
  --arch llama         models/llama.cpp's Llama (RMSNorm, RoPE on adjacent pairs, grouped-query
                       attention, SwiGLU; tied head), --init random only

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


class RMSNorm(nn.Module):
    """models/lean_ops.cpp's rms_norm: normalise in fp32, scale in the input's dtype."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * self.weight


def rope_tables(seq_len, head_dim, theta, device):
    freqs = torch.pow(theta, -torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rotary(x, cos, sin):
    """(B, T, H, D), adjacent pairs rotated, in fp32 (models/llama.cpp's apply_rotary_emb)."""
    b, t, h, d = x.shape
    pairs = x.float().unflatten(-1, (d // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.view(1, t, 1, d // 2), sin.view(1, t, 1, d // 2)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = apply_rotary(self.wq(h).view(b, t, self.n_heads, self.hd), cos, sin)
        k = apply_rotary(self.wk(h).view(b, t, self.n_kv, self.hd), cos, sin)
        v = self.wv(h).view(b, t, self.n_kv, self.hd)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.h = nn.ModuleList(LlamaBlock(cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"], cfg["ffn"])
                               for _ in range(cfg["n_layer"]))
        self.norm = RMSNorm(cfg["dim"])

    def forward(self, idx):
        cos, sin = rope_tables(idx.size(1), self.cfg["dim"] // self.cfg["n_heads"],
                               self.cfg["rope_theta"], idx.device)
        x = self.tok_embeddings(idx)
        for block in self.h:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.tok_embeddings.weight)  # tied head


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
        pos = torch.arange(idx.size(1), device=idx.device)
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


def random_model(a, device):
    """--init random: the shape from the arguments, built on the device, N(0, 0.02) weights."""
    if a.arch == "llama":
        cfg = {"vocab_size": a.vocab, "dim": a.n_embd, "n_layer": a.n_layer, "n_heads": a.n_head,
               "n_kv_heads": a.n_kv_head or a.n_head, "ffn": a.ffn, "rope_theta": a.rope_theta}
        cls = Llama
    else:
        cfg = {"vocab_size": a.vocab, "n_positions": a.seq_len, "n_embd": a.n_embd,
               "n_layer": a.n_layer, "n_head": a.n_head}
        cls = GPT
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = cls(cfg)
        for name, t in model.named_parameters():
            if t.dim() >= 2:
                nn.init.normal_(t, std=0.02)
    return model


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


def write_kernel_summary(profiler, path):
    """The device's kernels and copies of one profiled step, added up by name, as
    trainer/observe/kernel_profile.cpp writes fsdp-train's."""
    by_name = {}
    for e in profiler.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        count, ns = by_name.get(e.name(), (0, 0))
        by_name[e.name()] = (count + 1, ns + e.duration_ns())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    with open(path, "w") as f:
        json.dump({"steps": 1, "device_ns": sum(v[1] for _, v in rows),
                   "kernels": [{"name": k, "count": v[0], "ns": v[1]} for k, v in rows]}, f,
                  indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("fsdp2", "ddp", "single"), required=True)
    p.add_argument("--hf-dir")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--ac", action="store_true")
    p.add_argument("--gloo-loop-batch", action="store_true",
                   help="create Gloo's event-loop threads under SCHED_BATCH, as fsdp-cpp does "
                        "(docs/design.md, \"Gloo's event loop runs under SCHED_BATCH\"); off: "
                        "PyTorch as it is")
    p.add_argument("--init", choices=("hf", "random"), default="hf")
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=0)
    p.add_argument("--n-embd", type=int, default=0)
    p.add_argument("--n-head", type=int, default=0)
    p.add_argument("--n-kv-head", type=int, default=0)
    p.add_argument("--ffn", type=int, default=0)
    p.add_argument("--rope-theta", type=float, default=10000.0)
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
    p.add_argument("--kernel-profile-step", type=int, default=0,
                   help="record this step's device kernels with torch.profiler")
    p.add_argument("--kernel-profile-out", default="",
                   help="where that step's kernel summary goes (fsdp-train's rank0.kernels.json "
                        "layout: steps, device_ns, kernels [{name, count, ns}])")
    a = p.parse_args()

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = a.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        # Exact fp32 matmuls, as fsdp-train's (LibTorch's default).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if a.mode != "single":
        if cuda:
            dist.init_process_group("nccl", device_id=device)
        else:
            # Threads inherit the policy of their creator: Gloo's event loops (and, unlike in
            # fsdp-cpp, c10d's worker threads) are made in init_process_group.
            if a.gloo_loop_batch:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            dist.init_process_group("gloo")
            if a.gloo_loop_batch:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    elif world != 1:
        sys.exit("--mode single runs one process")

    if a.init == "random":
        model = random_model(a, device)
    else:
        if a.arch != "gpt" or not a.hf_dir:
            sys.exit("--init hf needs --hf-dir and --arch gpt")
        model, _ = load_gpt(a.hf_dir)
        model.to(device)
    bf16 = a.param_dtype == "bf16"
    if a.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.h):
            model.h[i] = checkpoint_wrapper(block)
    if a.mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        block_mp, root_mp = MixedPrecisionPolicy(), MixedPrecisionPolicy()
        if bf16:
            block_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
        for block in model.h:
            fully_shard(block, mp_policy=block_mp)
        fully_shard(model, mp_policy=root_mp)
    elif bf16:
        sys.exit("--param-dtype bf16 needs --mode fsdp2")
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
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        profiling = step == a.kernel_profile_step and cuda
        if profiling:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        start = time.perf_counter()
        xy = sampler.next().to(device)
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
        if profiling:
            profiler.__exit__(None, None, None)
            write_kernel_summary(profiler, a.kernel_profile_out)
        mean = torch.tensor([local_loss], dtype=torch.float64, device=device)
        if a.mode != "single":
            dist.all_reduce(mean)
        line = {"step": step, "loss": mean.item() / world, "step_time_s": step_s,
                "grad_norm": float(grad_norm), "rss_bytes": proc_status_bytes("VmRSS")}
        if cuda:
            line["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            line["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        out.write(json.dumps(line) + "\n")
    out.write(json.dumps({"summary": True, "fused_adamw": fused,
                          "peak_rss_bytes": proc_status_bytes("VmHWM"),
                          "rss_bytes": proc_status_bytes("VmRSS")}) + "\n")
    out.close()
    if a.mode != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
