#!/usr/bin/env python3
"""A Llama-architecture GGUF file cut to its first N blocks (same tensors, same bytes, the same
tokenizer and chat template; llama.block_count set to N).

    python scripts/cut_gguf.py IN.gguf OUT.gguf --blocks 8

Why: SmolLM2-135M-Instruct's Q4_1 file is 98 MB, and a GPU machine whose file transfers are
small (scripts/gpu_bundle.sh) takes the first blocks of the real pretrained model instead: the
GPU check fine-tunes that cut on the GPU and on the CPU (same file both times) and compares.
The tests whose claim is about the format or the arithmetic rather than the whole model's
answers run on a cut of 2 blocks for time (tests/python/smollm2_reference.py imports cut()).
Needs llama.cpp's `gguf` package (scripts/setup.sh --checks installs it).
"""
import argparse
import re
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def field_value(field):
    """A reader field as the writer takes it: (value, type, element type)."""
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        sub = types[1]
        if sub == GGUFValueType.STRING:
            values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        else:
            values = [field.parts[i].tolist()[0] for i in field.data]
        return values, GGUFValueType.ARRAY, sub
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8"), types[0], None
    return field.parts[field.data[0]].tolist()[0], types[0], None


def cut(input, output, blocks):
    """Writes `input`'s first `blocks` blocks to `output`; returns the line main() prints."""
    r = GGUFReader(input)
    arch = field_value(r.fields["general.architecture"])[0]
    count_key = f"{arch}.block_count"
    total = field_value(r.fields[count_key])[0]
    if not 1 <= blocks <= total:
        sys.exit(f"{input}: --blocks must be in 1..{total}")
    w = GGUFWriter(output, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype, sub = field_value(field)
        if key == count_key:
            value = blocks
        if key == "general.name":
            value = f"{value} (first {blocks} of {total} blocks)"
        w.add_key_value(key, value, vtype, sub_type=sub)
    kept = 0
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= blocks:
            continue
        # The reader's data is numpy-shaped, rows first; quantized tensors as rows of bytes,
        # which the writer turns back into the logical shape from the type.
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        kept += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return f"{output}: {kept} of {len(r.tensors)} tensors, {blocks} of {total} blocks"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--blocks", type=int, required=True)
    a = p.parse_args()
    print(cut(a.input, a.output, a.blocks))


if __name__ == "__main__":
    main()
