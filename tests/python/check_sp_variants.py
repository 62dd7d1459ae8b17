"""SentencePiece-style tokenizer.json files, encoded and decoded by the `tokenizers` library and
transformers, against our ids (tests/trainer/test_sentencepiece_bpe.cpp writes the cases).

usage: check_sp_variants.py tokenizers CASES
         CASES: JSON lines {"file", "text", "ids", "decoded"}; prints per file the texts whose
         ids and decoded text equal ours, and the first difference.
       check_sp_variants.py chat DIR CASES
         DIR: a model directory (tokenizer.json, tokenizer_config.json with a chat template);
         CASES: JSON lines {"messages", "ids"}; prints how many conversations
         apply_chat_template(tokenize=True) encodes to our ids.
"""
import json
import sys


def check_tokenizers(cases_path):
    from tokenizers import Tokenizer

    counts = {}
    first = {}
    loaded = {}
    for line in open(cases_path, encoding="utf-8"):
        c = json.loads(line)
        path = c["file"]
        if path not in loaded:
            loaded[path] = Tokenizer.from_file(path)
        tok = loaded[path]
        n = counts.setdefault(path, [0, 0, 0])
        n[2] += 1
        ids = tok.encode(c["text"], add_special_tokens=False).ids
        text = tok.decode(c["ids"], skip_special_tokens=False)
        n[0] += ids == c["ids"]
        n[1] += text == c["decoded"]
        if (ids != c["ids"] or text != c["decoded"]) and path not in first:
            first[path] = (f"{c['text']!r}: ids ours {c['ids'][:12]} theirs {ids[:12]}; "
                           f"decoded ours {c['decoded'][:40]!r} theirs {text[:40]!r}")
    for path, (enc, dec, total) in counts.items():
        name = path.rsplit("/", 1)[-1]
        print(f"{name}: encoded {enc}/{total} decoded {dec}/{total}")
        if path in first:
            print(f"  first difference: {first[path]}")


def check_chat(directory, cases_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    cases = [json.loads(line) for line in open(cases_path, encoding="utf-8")]
    same = 0
    for c in cases:
        ids = tok.apply_chat_template(c["messages"], tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if list(ids) == c["ids"]:
            same += 1
        else:
            print(f"differs: {c['messages']!r}\n  ours   {c['ids']}\n  theirs {list(ids)}")
    print(f"class {type(tok).__name__} chats {same}/{len(cases)} equal")


def main():
    if sys.argv[1] == "tokenizers":
        check_tokenizers(sys.argv[2])
    elif sys.argv[1] == "chat":
        check_chat(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")


if __name__ == "__main__":
    main()
