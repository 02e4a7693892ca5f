"""MATH -> megarl prompt file. See megarl/data/preprocess.py for the formats.

  python scripts/preprocess/math.py ~/data/MATH/train --output data/math/train.jsonl
  python scripts/preprocess/math.py ~/data/MATH-500/test.jsonl --output data/math/test.jsonl
"""

import os
import sys

# This file is named math.py and Python puts its folder first on the import path, so the standard
# library's own `import math` would load this script: take the folder off the path before importing.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

from megarl.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("math"))
