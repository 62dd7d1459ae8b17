#!/usr/bin/env python3
"""Reference NF4 for tests/test_lora.cpp, by bitsandbytes itself (CPU backend).

    check_nf4.py FILE.safetensors

FILE holds, for each tensor NAME, the original weight NAME and our NAME.codes, .absmax_codes,
.scales, .offset and .dequant, plus our tables nf4_values and scale_code. For each weight this
runs bitsandbytes.functional.quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True) and dequantize_4bit, and compares codes, 8-bit absmaxes and the
dequantized values with ours; it also dequantizes OUR quantized tensors with bitsandbytes. It
re-derives the 16 NF4 values from N(0, 1)'s inverse CDF as the QLoRA paper constructs them
(statistics.NormalDist, no scipy). Prints one JSON line.

bitsandbytes' CPU kernel codes the absmaxes through a 65536-entry lookup table over [-1, 1]
rather than by the nearest code value, so on near-ties (a value within ~1/65536 of the midpoint
of two codes) it can pick the farther one. For every absmax code where we differ, this reports
whether ours is at least as near ("absmax_codes_ours_nearer").
"""
import copy
import json
import statistics
import sys
import warnings

import torch
from safetensors.torch import load_file

warnings.filterwarnings("ignore")
import logging  # noqa: E402

logging.disable(logging.WARNING)  # bitsandbytes warns about optional CPU kernels
import bitsandbytes.functional as F  # noqa: E402


def nf4_from_quantiles():
    # Appendix E of the QLoRA paper: 8 positive and 7 negative quantiles of N(0, 1) between
    # offset and 1/2, with offset = 1/2 (1/32 + 1/30) ~ 0.9677, plus an exact 0, scaled to
    # [-1, 1]; bitsandbytes uses offset 0.9677083.
    nd = statistics.NormalDist()
    offset = 0.9677083

    def linspace(a, b, n):
        return [a + (b - a) * i / (n - 1) for i in range(n)]

    pos = [nd.inv_cdf(p) for p in linspace(offset, 0.5, 9)[:-1]]
    neg = [-nd.inv_cdf(p) for p in linspace(offset, 0.5, 8)[:-1]]
    v = sorted(pos + [0.0] + neg)
    m = max(abs(x) for x in v)
    return torch.tensor([x / m for x in v], dtype=torch.float64)


def main():
    t = load_file(sys.argv[1])
    out = {}
    bnb_nf4 = F.get_4bit_type("nf4", device="cpu").float()
    out["nf4_values_equal"] = bool(torch.equal(bnb_nf4, t["nf4_values"]))
    out["nf4_values_vs_quantiles"] = float(
        (nf4_from_quantiles() - t["nf4_values"].double()).abs().max())
    out["scale_code_equal"] = bool(torch.equal(F.create_dynamic_map(signed=True), t["scale_code"]))
    out["tensors"] = {}
    names = sorted(k for k in t if "." not in k and k not in ("nf4_values", "scale_code"))
    for name in names:
        w = t[name]
        q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        deq = F.dequantize_4bit(q, state).float()
        ours = t[name + ".dequant"]
        q = q.reshape(-1)
        # bitsandbytes dequantizing our tensors.
        mine = copy.deepcopy(state)
        mine.absmax = t[name + ".absmax_codes"].clone()
        mine.state2.absmax = t[name + ".scales"].clone()
        mine.offset = t[name + ".offset"].reshape(()).clone()
        deq_mine = F.dequantize_4bit(t[name + ".codes"].reshape(-1, 1).clone(), mine).float()
        # Where the absmax codes differ, is ours the nearer code value?
        absmax = F.quantize_4bit(w, blocksize=64, quant_type="nf4")[1].absmax.float()
        centred = (absmax - state.offset).reshape(-1)
        block_max = state.state2.absmax.repeat_interleave(256)[: centred.numel()]
        normed = centred / block_max
        code = F.create_dynamic_map(signed=True)
        ours_c, bnb_c = t[name + ".absmax_codes"].long(), state.absmax.reshape(-1).long()
        diff = (ours_c != bnb_c).nonzero().reshape(-1)
        nearer = bool(((normed[diff] - code[ours_c[diff]]).abs() <=
                       (normed[diff] - code[bnb_c[diff]]).abs()).all())
        out["tensors"][name] = {
            "absmaxes": int(centred.numel()),
            "absmax_codes_ours_nearer": nearer,
            "dequant_of_ours_max_diff": float((deq_mine - t[name + ".dequant"]).abs().max()),
            "codes_differ": int((q != t[name + ".codes"].reshape(-1)).sum()),
            "absmax_codes_differ": int((state.absmax.reshape(-1) != t[name + ".absmax_codes"]).sum()),
            "scales_max_diff": float((state.state2.absmax - t[name + ".scales"]).abs().max()),
            "offset_diff": float((state.offset.reshape(1) - t[name + ".offset"]).abs().max()),
            "dequant_max_diff": float((deq - ours).abs().max()),
            "ours_mean_abs_error": float((ours - w).abs().mean()),
            "bnb_mean_abs_error": float((deq - w).abs().mean()),
            "ours_max_abs_error": float((ours - w).abs().max()),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
