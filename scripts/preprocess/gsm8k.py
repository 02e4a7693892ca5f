"""GSM8K -> megarl prompt file. See megarl/data/preprocess.py for the formats.

  python scripts/preprocess/gsm8k.py ~/data/gsm8k/train.jsonl --output data/gsm8k/train.jsonl
  python scripts/preprocess/gsm8k.py ~/data/gsm8k/test.jsonl --output data/gsm8k/test.jsonl
"""

import os
import sys

# math.py beside this file would shadow the standard library's math module (Python puts this folder first
# on the import path): take the folder off the path before importing anything.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

from megarl.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("gsm8k"))
