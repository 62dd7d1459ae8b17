#!/usr/bin/env python3
"""Reference data for tests/trainer/test_hf_model.cpp: SmolLM2 as a Hugging Face directory.

    check_hf_dir.py sharded MODEL
        Prints "FILE <path>", MODEL's GGUF file ("smollm2", or "smollm2:N" for its first N
        blocks: smollm2_reference), and "DIR <path>": smollm2_reference's conversion of that
        file saved again by transformers in three safetensors files with
        model.safetensors.index.json.
    check_hf_dir.py tokenizers TEXT_FILE OUT_DIR
        Writes three tokenizer.json files under OUT_DIR/<variant>/ and OUT_DIR/ids.json, the
        ids the `tokenizers` library gives each line of TEXT_FILE (no special tokens added):
          saved   the converted directory's tokenizer.json as transformers wrote it
                  (pre-tokenizer ByteLevel with GPT-2's pattern);
          digits  the same vocabulary with the pre-tokenizer of SmolLM2's published
                  tokenizer.json: Digits (each digit alone), then ByteLevel;
          split   the same vocabulary with Llama 3's pre-tokenizer (Split by its pattern, then
                  ByteLevel without a pattern) and its ignore_merges.
"""
import copy
import json
import os
import sys

import smollm2_reference

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def variants(saved):
    digits = copy.deepcopy(saved)
    digits["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    split = copy.deepcopy(saved)
    split["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    split["model"]["ignore_merges"] = True
    return {"saved": saved, "digits": digits, "split": split}


def tokenizers_command(text_file, out_dir):
    from tokenizers import Tokenizer
    with open(os.path.join(smollm2_reference.reference_dir(), "tokenizer.json"),
              encoding="utf-8") as f:
        saved = json.load(f)
    with open(text_file, encoding="utf-8", newline="") as f:  # keep "\r\n" as it is
        lines = f.read().split("\n")
    ids = {}
    for name, spec in variants(saved).items():
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f, ensure_ascii=False)
        tok = Tokenizer.from_file(path)
        ids[name] = [tok.encode(line, add_special_tokens=False).ids for line in lines]
    with open(os.path.join(out_dir, "ids.json"), "w") as f:
        json.dump(ids, f)


def main():
    if sys.argv[1:2] == ["sharded"] and len(sys.argv) == 3:
        print("FILE", smollm2_reference.gguf_path(sys.argv[2]))
        print("DIR", smollm2_reference.sharded_dir(sys.argv[2]))
    elif sys.argv[1:2] == ["tokenizers"] and len(sys.argv) == 4:
        tokenizers_command(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
