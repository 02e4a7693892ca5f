"""Geometry3K (verl's geo3k scorer): 0.9 for the right `\\boxed{}` answer plus 0.1 for the format, a
`<think>...</think>` before the boxed answer. A response without a `\\boxed{}` scores 0 (the format needs the box too).

The last `\\boxed{}` of the response is its answer, checked against the reference by math-verify (math.py: `3\\sqrt{2}`
= `\\sqrt{18}`, `90^\\circ` = `90`); verl grades it with mathruler's grade_answer (normalised strings, then sympy),
which agrees on plain numbers and LaTeX but refuses an unreduced fraction for a reduced one.
"""

from __future__ import annotations

import re

from megarl.rewards import REWARDS
from megarl.rewards.math import math_equal
from megarl.rewards.math_dapo import last_boxed

THINK_THEN_BOXED = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
FORMAT_WEIGHT = 0.1


@REWARDS.register("geo3k")
def geo3k_reward(response: str, answer: str, sample: dict) -> float:
    boxed = last_boxed(response)
    correct = boxed is not None and bool(boxed.strip()) and math_equal("\\boxed{" + boxed.strip() + "}", answer)
    return (1.0 - FORMAT_WEIGHT) * correct + FORMAT_WEIGHT * bool(THINK_THEN_BOXED.fullmatch(response))
