#!/usr/bin/env python3
"""What transformers makes of an fsdp-train export (tests/trainer/test_trainer.cpp): the
directory loaded as it is, with no file of ours beside it.

    check_export.py [--wait] DIR JSONL NEW_TOKENS TEXT_FILE OUT

OUT (JSON): "answer", pipeline("text-generation", DIR)'s greedy reply (NEW_TOKENS at most) to
JSONL's first conversation without its last (assistant) turn; "ids", AutoTokenizer's ids of each
line of TEXT_FILE (no special tokens added). --wait: import torch and transformers first, then
wait for a line on the standard input before reading DIR (the test starts this before the run
that writes DIR, so that the seconds of importing overlap with it).
"""
import json
import sys


def main():
    args = sys.argv[1:]
    wait = args[:1] == ["--wait"]
    if len(args) != 5 + wait:
        sys.exit(__doc__)
    directory, jsonl, new_tokens, text_file, out = args[wait:]
    import torch
    from transformers import AutoTokenizer, pipeline
    if wait and not sys.stdin.readline():
        sys.exit("the test ended before its export was written")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(directory)
    with open(text_file, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    ids = [tok.encode(line, add_special_tokens=False) for line in lines]
    with open(jsonl, encoding="utf-8") as f:
        messages = json.loads(f.readline())["messages"][:-1]
    generate = pipeline("text-generation", model=directory, dtype=torch.float32, device="cpu")
    reply = generate(messages, max_new_tokens=int(new_tokens), do_sample=False)
    answer = reply[0]["generated_text"][-1]["content"]
    with open(out, "w") as f:
        json.dump({"answer": answer, "ids": ids}, f)


if __name__ == "__main__":
    main()
