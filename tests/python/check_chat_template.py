"""Chat templates rendered by transformers, for tests/trainer/test_chat_template.cpp.

usage: check_chat_template.py CASES OUT
CASES is a JSON list of {"template", "bos", "eos", "messages", "add_generation_prompt"}; OUT gets
the JSON list of transformers' apply_chat_template(tokenize=False) texts, or of
{"error": message} where the template raises (Mistral's role checks).
"""
import json
import sys

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast


def main():
    cases = json.load(open(sys.argv[1], encoding="utf-8"))
    # Rendering needs no vocabulary: the template and the special tokens' texts are passed in.
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    out = []
    for c in cases:
        try:
            out.append(tok.apply_chat_template(
                c["messages"], chat_template=c["template"], tokenize=False,
                add_generation_prompt=c["add_generation_prompt"], bos_token=c["bos"],
                eos_token=c["eos"]))
        except Exception as e:  # jinja2's TemplateError from raise_exception
            out.append({"error": str(e)})
    json.dump(out, open(sys.argv[2], "w", encoding="utf-8"))


if __name__ == "__main__":
    main()
