"""GSM8K -> megarl prompt file, or verl's train.parquet/test.parquet. See megarl/data/preprocess.py for the formats.

megarl's layout (one prompt file per command):

  python scripts/preprocess/gsm8k.py ~/data/gsm8k/train.jsonl --output data/gsm8k/train.jsonl
  python scripts/preprocess/gsm8k.py ~/data/gsm8k/test.jsonl --output data/gsm8k/test.jsonl

verl's layout, from a downloaded copy of openai/gsm8k (this script downloads nothing; without
--local_dataset_path it says what to download):

  verl:    python examples/data_preprocess/gsm8k.py --local_dir ../data/gsm8k
  megarl:  python scripts/preprocess/gsm8k.py --local_dataset_path ~/data/raw/gsm8k --local_dir ../data/gsm8k

  then     data.task=../data/gsm8k/train.parquet data.val_task=../data/gsm8k/test.parquet reward.name=gsm8k
           (verl's data.train_files and data.val_files)
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
