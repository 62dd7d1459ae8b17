"""Python's view of fsdp-cpp's Hugging Face directories (run by tests/test_hf_format.cpp).

  check_hf.py export DIR OURS
      DIR was written by fsdp-cpp (save_hf); OURS is a safetensors file holding the same model's
      parameters under fsdp-cpp's names, plus 'input_ids' and 'logits' (fsdp-cpp's forward).
      Checks, with Python's own libraries and this file's own mapping: every tensor of
      DIR/model.safetensors, or of the sharded files its index names (read by `safetensors`),
      equals ours mapped to transformers' names and layout and cast to config.json's
      torch_dtype, bitwise; transformers loads DIR with no missing, unexpected or mismatched
      weights; its logits on input_ids equal ours within TOLERANCE (fp32; bf16 / fp16: 3% of
      the largest logit). Prints the largest difference.

  check_hf.py make DIR REFERENCE_DIR SEED OUT [--zero-qkv-bias]
      Builds a transformers model from REFERENCE_DIR/config.json with random weights (every
      parameter, norms included, from SEED; GPT-2's q/k/v biases zero with --zero-qkv-bias),
      writes it with save_pretrained into DIR and its logits on fixed input ids into OUT
      ('input_ids', 'logits'): fsdp-cpp loads DIR and must compute the same logits.

  check_hf.py COMMAND ... + COMMAND ...
      Several of the above in order, in one process (one import of torch and transformers).

Exit code 0 when every check passes; 1 with a message otherwise.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

# fp32 logits of models of width <= 64 computed by two implementations (fused SDPA kernels vs
# ours, another summation order in the matmuls): differences of a few ulps of values ~1 are
# expected; 1e-5 is ~100 ulps and fails on any real mapping error (those give differences ~1).
TOLERANCE = 1e-5


def fail(message):
    print("check_hf: " + message)
    sys.exit(1)


def gpt2_expected(ours, config):
    """fsdp-cpp's GPT parameters under transformers' GPT-2 names and layout."""
    out = {}
    for name, t in ours.items():
        if name in ("input_ids", "logits"):
            continue
        if name.startswith("h") and name[1].isdigit():
            layer, rest = name[1:].split(".", 1)
            hf = f"transformer.h.{layer}.{rest}"
        elif name == "lm_head.weight":
            hf = name
        else:
            hf = "transformer." + name
        # GPT-2's Conv1D stores weights as [in, out]; torch.nn.Linear as [out, in].
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = t.t().contiguous()
        out[hf] = t
    for i in range(config.n_layer):
        out.setdefault(f"transformer.h.{i}.attn.c_attn.bias", torch.zeros(3 * config.n_embd))
    return out


def permute_for_rotate_half(w, heads):
    """transformers' convert_llama_weights_to_hf.py: Meta's interleaved q/k rows -> halves."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def llama_expected(ours, config):
    parts = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    out = {}
    for name, t in ours.items():
        if name in ("input_ids", "logits"):
            continue
        if name == "tok_embeddings.weight":
            hf = "model.embed_tokens.weight"
        elif name == "norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, rest = name.split(".", 1)  # "layers", "<i>.<module>.weight"
            layer, rest = rest.split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            hf = f"model.layers.{layer}.{parts[module]}.{leaf}"
            if module == "attention.wq":
                t = permute_for_rotate_half(t, config.num_attention_heads)
            elif module == "attention.wk":
                t = permute_for_rotate_half(t, config.num_key_value_heads)
        out[hf] = t
    return out


def stored_tensors(directory):
    """Every tensor of the directory's weights: model.safetensors, or the files of its index,
    each checked to hold exactly the tensors the index places in it."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return load_file(os.path.join(directory, "model.safetensors")), 1
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    stored = {}
    files = sorted(set(weight_map.values()))
    for name in files:
        part = load_file(os.path.join(directory, name))
        placed = sorted(t for t, file in weight_map.items() if file == name)
        if sorted(part) != placed:
            fail(f"{name} holds {sorted(part)}, the index places {placed} in it")
        stored.update(part)
    return stored, len(files)


def check_export(directory, ours_path):
    ours = load_file(ours_path)
    config = AutoConfig.from_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        dtype = getattr(torch, json.load(f)["torch_dtype"])
    stored, files = stored_tensors(directory)
    expected = (gpt2_expected if config.model_type == "gpt2" else llama_expected)(ours, config)
    if sorted(stored) != sorted(expected):
        fail(f"tensor names differ: file has {sorted(set(stored) - set(expected))} extra, "
             f"lacks {sorted(set(expected) - set(stored))}")
    for name, t in expected.items():
        # Exports in bf16 / fp16: ours rounded to nearest even, as torch rounds.
        if stored[name].dtype != dtype or not torch.equal(stored[name], t.to(dtype)):
            fail(f"tensor {name} differs from ours mapped by this script (in {dtype})")
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            fail(f"from_pretrained reports {kind}: {info[kind]}")
    model.eval()
    with torch.no_grad():
        logits = model(ours["input_ids"]).logits
    diff = (logits - ours["logits"]).abs().max().item()
    # Rounded weights compute other logits: bf16 keeps 8 bits of mantissa, so a few percent of
    # the largest logit (a mapping error gives differences of its order).
    tolerance = TOLERANCE if dtype == torch.float32 else 0.03 * ours["logits"].abs().max().item()
    print(f"{config.model_type}: {len(stored)} tensors in {files} file(s) equal in {dtype}; "
          f"transformers' logits {tuple(logits.shape)} max |diff| {diff:.3g} "
          f"(tolerance {tolerance:.3g})")
    if not diff <= tolerance:
        fail(f"logits differ by {diff}")


def make(directory, reference_dir, seed, out_path, zero_qkv_bias):
    config = AutoConfig.from_pretrained(reference_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        if zero_qkv_bias:
            for name, p in model.named_parameters():
                if name.endswith("attn.c_attn.bias"):
                    p.zero_()
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(config.vocab_size, (2, 9), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits
    save_file({"input_ids": input_ids, "logits": logits.contiguous()}, out_path)
    print(f"{config.model_type}: written by transformers into {directory}")


def run(args):
    if len(args) == 3 and args[0] == "export":
        check_export(args[1], args[2])
    elif len(args) in (5, 6) and args[0] == "make":
        if len(args) == 6 and args[5] != "--zero-qkv-bias":
            fail(__doc__)
        make(args[1], args[2], int(args[3]), args[4], len(args) == 6)
    else:
        fail(__doc__)


def main(argv):
    # Commands separated by "+" run in order in this one process: importing torch and
    # transformers costs seconds of CPU, which a test pays once instead of once per command.
    command = []
    for word in argv[1:] + ["+"]:
        if word != "+":
            command.append(word)
        elif command:
            run(command)
            command = []


if __name__ == "__main__":
    main(sys.argv)
