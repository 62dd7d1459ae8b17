"""Greedy text generation by transformers' pipeline() from a model directory we exported.

usage: check_generate.py DIR PROMPT NEW_TOKENS OUT
OUT (JSON): "text", the prompt and its greedy continuation (NEW_TOKENS at most, fp32) as
pipeline("text-generation", DIR) returns it; "new_ids", the generated token ids.
"""
import json
import sys


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    directory, prompt, new_tokens, out = sys.argv[1:]
    import torch
    from transformers import pipeline
    torch.set_num_threads(1)
    generate = pipeline("text-generation", model=directory, dtype=torch.float32, device="cpu")
    reply = generate(prompt, max_new_tokens=int(new_tokens), do_sample=False)
    ids = generate.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full = generate.model.generate(torch.tensor([ids]), max_new_tokens=int(new_tokens),
                                   do_sample=False)
    with open(out, "w") as f:
        json.dump({"text": reply[0]["generated_text"], "new_ids": full[0][len(ids):].tolist()}, f)


if __name__ == "__main__":
    main()
