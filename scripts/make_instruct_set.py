#!/usr/bin/env python3
"""Make a small chat-format instruction set from the King James Bible (public domain).

    python3 scripts/make_instruct_set.py [OUT_DIR]      (OUT_DIR defaults to data/instruct)

Reads the whole KJV from Debian's bible-kjv (`bible -p /usr/lib Gen1:1-Rev22:21`, the same
command trainer/data/corpus.cpp runs) and writes OUT_DIR/kjv_train.jsonl (360 examples) and
OUT_DIR/kjv_eval.jsonl (40 examples). Each line is one JSON object:

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}

(a few examples start with a "system" message). Three tasks, one fixed wording each, so a
small model can learn a consistent, checkable style:
    quote     "Quote Psalm 23:1 from the King James Bible."  -> the verse, exactly
    identify  "Which book of the Bible says: \"<verse>\"?"    -> "Psalm 23:1."
    finish    "Finish this verse from John 3:16: \"<first part>...\"" -> the rest, exactly
Every example uses its own verse, so the eval verses are disjoint from the train verses.
The output is deterministic: a fixed seed, no clocks, no dict-order dependence; two runs give
byte-identical files. Python 3 standard library only.
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

BIBLE_DATA_DIR = "/usr/lib"
BIBLE_RANGE = "Gen1:1-Rev22:21"
EXPECTED_CHAPTERS = 1189
EXPECTED_VERSES = 31102
SEED = 1611  # the year the King James Version was published

N_TRAIN = 360
N_EVAL = 40
# Of the selected verses, how many come from the well-known chapters below (the rest are a
# seeded random sample of the whole Bible), per split.
N_FAMOUS = {"train": 200, "eval": 20}
# Task mix per split: quote 60 %, identify 20 %, finish 20 %.
TASK_COUNTS = {
    "train": {"quote": 216, "identify": 72, "finish": 72},
    "eval": {"quote": 24, "identify": 8, "finish": 8},
}
# Examples that start with a system message, per split.
N_SYSTEM = {"train": 24, "eval": 2}
SYSTEM_PROMPT = "You are a helpful assistant who quotes the King James Bible word for word."

MIN_WORDS = 6
MAX_WORDS = 30

# Well-known chapters, as (book as `bible` prints it, chapter). Every eligible verse of the core
# chapters is used; the extra ones fill the rest of N_FAMOUS by a seeded sample.
CORE_CHAPTERS = [
    ("Genesis", 1), ("Psalms", 23), ("Proverbs", 3), ("Ecclesiastes", 3), ("Matthew", 5),
    ("John", 1), ("John", 3), ("1 Corinthians", 13),
]
EXTRA_CHAPTERS = [
    ("Genesis", 2), ("Genesis", 3), ("Exodus", 20), ("Psalms", 1), ("Psalms", 91),
    ("Psalms", 121), ("Psalms", 139), ("Isaiah", 40), ("Isaiah", 53), ("Matthew", 6),
    ("Luke", 2), ("John", 14), ("Romans", 8), ("Philippians", 4), ("Hebrews", 11),
    ("Revelation", 21),
]

HEADER_RE = re.compile(r"^(\S.*) ([0-9]+)$")
VERSE_RE = re.compile(r"^  ([0-9]+) (.*)$")


def fail(message):
    sys.exit("make_instruct_set.py: " + message)


def read_bible():
    """The whole KJV as [(book, chapter, verse, text)] in canonical order."""
    if shutil.which("bible") is None:
        fail("needs Debian's bible-kjv (no `bible` program): apt-get install bible-kjv bible-kjv-text")
    if not os.path.exists(os.path.join(BIBLE_DATA_DIR, "bible.data")):
        fail(f"needs Debian's bible-kjv-text ({BIBLE_DATA_DIR}/bible.data is missing)")
    out = subprocess.run(["bible", "-p", BIBLE_DATA_DIR, BIBLE_RANGE], stdout=subprocess.PIPE,
                         check=True, env=dict(os.environ, LC_ALL="C")).stdout.decode("utf-8")
    # Format: a blank line, "<Book> <chapter>", a blank line, then verses as "  <n> <text>" with
    # the text wrapped onto continuation lines that have no indent.
    verses = []
    book = chapter = None
    chapters = 0
    previous_blank = True
    for raw in out.split("\n"):
        line = raw.rstrip()
        if not line:
            previous_blank = True
            continue
        header = HEADER_RE.match(line) if previous_blank else None
        previous_blank = False
        if header:
            book, chapter = header.group(1), int(header.group(2))
            chapters += 1
            continue
        verse = VERSE_RE.match(line)
        if verse:
            if book is None:
                fail("verse before any chapter header in `bible` output")
            number = int(verse.group(1))
            expected = verses[-1][2] + 1 if verses and verses[-1][:2] == (book, chapter) else 1
            if number != expected:
                fail(f"{book} {chapter}: verse {number} where {expected} was expected")
            verses.append((book, chapter, number, verse.group(2).strip()))
        else:
            if not verses:
                fail(f"unexpected line in `bible` output: {line!r}")
            b, c, v, text = verses[-1]
            verses[-1] = (b, c, v, text + " " + line.strip())
    if chapters != EXPECTED_CHAPTERS or len(verses) != EXPECTED_VERSES:
        fail(f"`bible` printed {chapters} chapters and {len(verses)} verses, expected "
             f"{EXPECTED_CHAPTERS} and {EXPECTED_VERSES}")
    return verses


def reference(book, chapter, verse):
    # One psalm is "Psalm 23", the book is "Psalms": always "Psalm 23:1" in references.
    name = "Psalm" if book == "Psalms" else book
    return f"{name} {chapter}:{verse}"


def eligible(text, duplicated):
    words = text.split()
    return (MIN_WORDS <= len(words) <= MAX_WORDS and text[-1] in ".?!"
            and text[0].isupper() and text not in duplicated)


def split_point(words):
    """Where to cut a verse for the finish task: at a , ; : nearest the middle, else the middle."""
    n = len(words)
    lo, hi = max(3, -(-n * 35 // 100)), min(n - 3, n * 65 // 100)
    best = None
    for k in range(lo, hi + 1):
        if words[k - 1][-1] in ",;:":
            if best is None or abs(2 * k - n) < abs(2 * best - n):
                best = k
    return best if best is not None else n // 2


def make_example(task, verse, with_system):
    book, chapter, number, text = verse
    ref = reference(book, chapter, number)
    if task == "quote":
        user, assistant = f"Quote {ref} from the King James Bible.", text
    elif task == "identify":
        user, assistant = f'Which book of the Bible says: "{text}"?', f"{ref}."
    else:
        words = text.split()
        k = split_point(words)
        user = f'Finish this verse from {ref}: "{" ".join(words[:k])}..."'
        assistant = " ".join(words[k:])
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    if with_system:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return {"messages": messages}


def build(verses):
    rng = random.Random(SEED)
    counts = {}
    for v in verses:
        counts[v[3]] = counts.get(v[3], 0) + 1
    duplicated = {text for text, c in counts.items() if c > 1}
    pool = [v for v in verses if eligible(v[3], duplicated)]

    core_set, extra_set = set(CORE_CHAPTERS), set(EXTRA_CHAPTERS)
    core = [v for v in pool if (v[0], v[1]) in core_set]
    extra = [v for v in pool if (v[0], v[1]) in extra_set]
    others = [v for v in pool if (v[0], v[1]) not in core_set | extra_set]
    n_famous = N_FAMOUS["train"] + N_FAMOUS["eval"]
    n_others = N_TRAIN + N_EVAL - n_famous
    if not len(core) <= n_famous <= len(core) + len(extra) or len(others) < n_others:
        fail(f"{len(core)} core, {len(extra)} extra and {len(others)} other eligible verses "
             f"do not fit {n_famous} well-known and {n_others} other ones")

    # Sample (order stays random), then cut each sample into eval and train: every verse is
    # used once, so the two splits share no verse.
    famous = core + rng.sample(extra, n_famous - len(core))
    rng.shuffle(famous)
    others = rng.sample(others, n_others)
    splits = {
        "eval": famous[:N_FAMOUS["eval"]] + others[:N_EVAL - N_FAMOUS["eval"]],
        "train": famous[N_FAMOUS["eval"]:] + others[N_EVAL - N_FAMOUS["eval"]:],
    }
    out = {}
    for name in ("train", "eval"):
        chosen = splits[name]
        rng.shuffle(chosen)
        tasks = [t for t in ("quote", "identify", "finish") for _ in range(TASK_COUNTS[name][t])]
        assert len(tasks) == len(chosen)
        rng.shuffle(tasks)
        system = set(rng.sample(range(len(chosen)), N_SYSTEM[name]))
        out[name] = [make_example(t, v, i in system)
                     for i, (t, v) in enumerate(zip(tasks, chosen))]
    return out


def main():
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default=str(root / "data" / "instruct"),
                        help="output directory (default: data/instruct in the repository)")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, examples in build(read_bible()).items():
        path = out_dir / f"kjv_{name}.jsonl"
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for example in examples:
                f.write(json.dumps(example, ensure_ascii=False) + "\n")
        print(f"{path}: {len(examples)} examples")


if __name__ == "__main__":
    main()
