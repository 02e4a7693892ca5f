"""MATH -> megarl prompt file, or verl's train.parquet/test.parquet. See megarl/data/preprocess.py for the formats.

megarl's layout (one prompt file per command):

  python scripts/preprocess/math.py ~/data/MATH/train --output data/math/train.jsonl
  python scripts/preprocess/math.py ~/data/MATH-500/test.jsonl --output data/math/test.jsonl

verl's layout, from a downloaded copy of DigitalLearningGmbH/MATH-lighteval or the original MATH release (this
script downloads nothing; without --local_dataset_path it says what to download):

  verl:    python examples/data_preprocess/math_dataset.py --local_dir ../data/math
  megarl:  python scripts/preprocess/math.py --local_dataset_path ~/data/raw/math --local_dir ../data/math

  then     data.task=../data/math/train.parquet data.val_task=../data/math/test.parquet reward.name=math
           (verl's data.train_files and data.val_files)
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
