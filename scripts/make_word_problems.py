"""GSM8K-format word problems on two-digit numbers, written offline as megarl prompt files ({"prompt", "answer"} per
row, the prompt ending in GSM8K's instruction): a task a small instruct model partly solves (configs/
smollm2_gsm8k_grpo.yaml; reward gsm8k_flexible, the last number of the response).

  python scripts/make_word_problems.py --out data/word_problems   # train.jsonl (4000), test.jsonl (256)

Each problem is one template (addition or subtraction in a story) with two numbers in [10, 99]; the held-out
problems' (template, numbers) never occur in the training file. Seeded: the same files every time.
"""

import argparse
import json
import random
from pathlib import Path

from megarl.data.preprocess import GSM8K_INSTRUCTION

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack", "Lena", "Omar"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells"]
# (story, answer from a and b); subtraction stories take a > b
TEMPLATES = [
    ("{n} has {a} {i}. {m} gives {n} {b} more {i}. How many {i} does {n} have now?", lambda a, b: a + b),
    ("A box holds {a} {i} and a bag holds {b} {i}. How many {i} are there in all?", lambda a, b: a + b),
    ("{n} had {a} {i} and gave {b} of them to {m}. How many {i} does {n} have left?", lambda a, b: a - b),
    ("{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} collect?", lambda a, b: a + b),
    ("There were {a} {i} on a shelf. {n} took {b} of them. How many {i} are on the shelf now?", lambda a, b: a - b),
]


def problems(seed: int):
    """Every (template, a, b) once, shuffled: [(key, row)]."""
    rng = random.Random(seed)
    keys = [(t, a, b) for t, (story, answer) in enumerate(TEMPLATES) for a in range(10, 100) for b in range(10, 100)
            if answer(a, b) > 0]
    rng.shuffle(keys)
    for t, a, b in keys:
        story, answer = TEMPLATES[t]
        n, m = rng.sample(NAMES, 2)
        text = story.format(n=n, m=m, a=a, b=b, i=rng.choice(ITEMS))
        yield (t, a, b), {"prompt": f"{text} {GSM8K_INSTRUCTION}", "answer": str(answer(a, b))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--train", type=int, default=4000, help="training problems")
    parser.add_argument("--test", type=int, default=256, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [row for _, (_, row) in zip(range(args.test + args.train), problems(args.seed))]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test", rows[:args.test]), ("train", rows[args.test:])):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"wrote {args.out}/train.jsonl ({args.train}) and {args.out}/test.jsonl ({args.test})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
