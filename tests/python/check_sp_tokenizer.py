"""Our SentencePiece tokenizer written as tokenizer.json, read by transformers.

usage: check_sp_tokenizer.py DIR CASES
DIR holds tokenizer.json, tokenizer_config.json, generation_config.json (what a pretraining export
carries); CASES is JSON lines {"text": ..., "ids": [...]} with our ids for each text. Prints one
line of counts (texts whose ids equal ours, texts decoded back exactly) and the first mismatch.
"""
import json
import sys

from transformers import AutoTokenizer


def main():
    directory, cases_path = sys.argv[1:3]
    tok = AutoTokenizer.from_pretrained(directory)
    cases = [json.loads(line) for line in open(cases_path, encoding="utf-8")]
    encoded = decoded = 0
    first = None
    for c in cases:
        ids = tok.encode(c["text"], add_special_tokens=False)
        if ids == c["ids"]:
            encoded += 1
        elif first is None:
            first = f"first mismatch: {c['text']!r}: ours {c['ids'][:20]} transformers {ids[:20]}"
        if tok.decode(c["ids"]) == c["text"]:
            decoded += 1
    print(f"class {type(tok).__name__} vocab {len(tok)} bos {tok.bos_token} eos {tok.eos_token} "
          f"unk {tok.unk_token}")
    print(f"encoded {encoded}/{len(cases)} decoded {decoded}/{len(cases)}")
    if first:
        print(first)


if __name__ == "__main__":
    main()
