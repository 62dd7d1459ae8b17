#!/usr/bin/env python3
"""Reference logits for our QLoRA base (tests/test_lora.cpp), by transformers and bitsandbytes.

    check_qlora.py MODEL OUT_DIR ID [ID ...]

Loads SmolLM2-135M-Instruct (MODEL "smollm2", or "smollm2:N" for its first N blocks) as
transformers' GGUF loader reads it, from smollm2_reference's cached conversion of that load
(the same weights bit for bit), writes its float32 logits for the token ids to
OUT_DIR/dense.bin, then replaces the weight of every Linear inside the decoder layers by
bitsandbytes' NF4 round trip (quantize_4bit, nf4, blocksize 64, compress_statistics;
dequantize_4bit) and writes those logits to OUT_DIR/nf4.bin, and again with the 8-bit absmax
codes chosen by exact nearest value (our rule) to OUT_DIR/nf4_nearest.bin. q_proj and k_proj
are quantized in the GGUF (Meta) row order, which is ours: transformers permutes their rows
for its rotate-half RoPE, and the second quantization's blocks of 256 absmaxes span rows, so
the order matters.
"""
import logging
import os
import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import bitsandbytes.functional as F  # noqa: E402

# transformers' GGUF load takes ~11 s (its tokenizer ~3 s); smollm2_reference does it once and
# caches the result as a Hugging Face directory (the same weights bit for bit), loaded in < 1 s.
import smollm2_reference  # noqa: E402


def to_meta(w, heads):
    # transformers' rotate-half rows back to Meta's interleaved pairs.
    return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def to_hf(w, heads):
    return w.view(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def nf4_round_trip(w, nearest):
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    if nearest:
        # The 8-bit absmax codes by exact nearest value (a tie to the lower), where bitsandbytes'
        # CPU kernel goes through a 65536-entry lookup table that rounds some near-ties the
        # other way.
        absmax = F.quantize_4bit(w, blocksize=64, quant_type="nf4")[1].absmax.float().reshape(-1)
        scale = state.state2.absmax.repeat_interleave(256)[: absmax.numel()]
        normed = (absmax - state.offset) / scale
        code = F.create_dynamic_map(signed=True)
        left = (torch.searchsorted(code, normed, right=True) - 1).clamp(0, 255)
        right = (left + 1).clamp(max=255)
        closer = (normed - code[right]).abs() < (normed - code[left]).abs()
        state.absmax = torch.where(closer, right, left).to(torch.uint8)
    return F.dequantize_4bit(q, state).float()


def main():
    out_dir = sys.argv[2]
    ids = torch.tensor([[int(i) for i in sys.argv[3:]]])
    model = smollm2_reference.load_model(sys.argv[1])
    with torch.no_grad():
        np.ascontiguousarray(model(ids).logits[0].numpy()).tofile(
            os.path.join(out_dir, "dense.bin"))
        dense = {k: v.clone() for k, v in model.state_dict().items()}
        for nearest, out in ((False, "nf4.bin"), (True, "nf4_nearest.bin")):
            model.load_state_dict(dense)
            n = quantize_blocks(model, nearest)
            np.ascontiguousarray(model(ids).logits[0].numpy()).tofile(os.path.join(out_dir, out))
    print("quantized linears", n)


def quantize_blocks(model, nearest):
    heads = {"q_proj": model.config.num_attention_heads,
             "k_proj": model.config.num_key_value_heads}
    n = 0
    for layer in model.model.layers:
        for name, m in layer.named_modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            h = heads.get(name.split(".")[-1])
            w = m.weight.data
            if h:
                assert torch.equal(to_hf(to_meta(w, h), h), w)
                m.weight.data = to_hf(nf4_round_trip(to_meta(w, h), nearest), h)
            else:
                m.weight.data = nf4_round_trip(w, nearest)
            n += 1
    return n


if __name__ == "__main__":
    main()
