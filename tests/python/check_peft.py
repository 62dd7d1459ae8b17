#!/usr/bin/env python3
"""Reference logits for our LoRA exports (tests/test_lora.cpp), by transformers and peft.

    check_peft.py [--wait] MODEL ADAPTER_DIR MERGED_DIR OUT_DIR ID [ID ...]

Loads SmolLM2-135M-Instruct (MODEL "smollm2", or "smollm2:N" for its first N blocks) as
transformers' own GGUF loader reads it (the base our model was loaded from), from
smollm2_reference's cached conversion of that load (the same weights bit for bit), applies ADAPTER_DIR (adapter_config.json + adapter_model.safetensors, our PEFT export)
with peft.PeftModel.from_pretrained, and writes the float32 logits for the token ids to
OUT_DIR/peft.bin; loads MERGED_DIR (our merged Hugging Face export) with
AutoModelForCausalLM.from_pretrained and writes its logits to OUT_DIR/merged.bin. Prints the
adapter's module count, and fails if peft reports missing or unexpected adapter weights.
--wait: import and load the base model first, then wait for a line on the standard input before
reading ADAPTER_DIR and MERGED_DIR (the test starts this before its ranks write them, so that
the seconds of importing overlap with their work).
"""
import logging
import os
import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

# transformers' GGUF load takes ~11 s (its tokenizer ~3 s); smollm2_reference does it once and
# caches the result as a Hugging Face directory (the same weights bit for bit), loaded in < 1 s.
import smollm2_reference  # noqa: E402


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0].float().numpy()


def main():
    args = sys.argv[1:]
    wait = args[:1] == ["--wait"]
    model_name, adapter_dir, merged_dir, out_dir = args[wait:wait + 4]
    ids = torch.tensor([[int(i) for i in args[wait + 4:]]])
    base = smollm2_reference.load_model(model_name)
    if wait:
        smollm2_reference.wait_for_test()
    model = PeftModel.from_pretrained(base, adapter_dir)
    # Every lora_A/lora_B of the model must have come from the file: PeftModel leaves a weight
    # it did not find at its initial value, so compare with the file.
    from safetensors.torch import load_file
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    state = model.state_dict()
    loaded = 0
    for name, t in saved.items():
        key = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        if key not in state:
            sys.exit(f"peft model has no '{key}' for the file's '{name}'")
        if not torch.equal(state[key].float(), t.float()):
            sys.exit(f"'{key}' was not loaded from the file")
        loaded += 1
    adapters = sum(1 for k in state if ".lora_A.default.weight" in k)
    if adapters * 2 != loaded:
        sys.exit(f"the model has {adapters} adapted modules, the file {loaded} tensors")
    np.ascontiguousarray(logits(model, ids)).tofile(os.path.join(out_dir, "peft.bin"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    np.ascontiguousarray(logits(merged, ids)).tofile(os.path.join(out_dir, "merged.bin"))
    print("adapted modules", adapters)


if __name__ == "__main__":
    main()
