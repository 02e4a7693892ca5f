"""DAPO's math reward (verl's math_dapo scorer, the one verl gives the data sources math_dapo, math and aime*):
+1.0 for the right answer, -1.0 for anything else (no answer included).

Only the last 300 characters of the response count. The answer is what follows the last `Answer:` there (any
case, up to the end of its line); a response without one falls back to its last `\\boxed{}` within its last 100
characters. The answer and the reference are both put through Minerva's normalisation (Lewkowycz et al. 2022,
"Solving quantitative reasoning problems with language models", appendix D: units and filler words dropped,
`\\text{}`/`\\boxed{}` unwrapped, `\\frac12` -> `\\frac{1}{2}`, thousands commas dropped) and compared as strings:
`Answer: 1,000 dollars` is right for 1000, `Answer: 0.5` is wrong for \\frac{1}{2} (no mathematical equivalence,
unlike the `math` reward).
"""

from __future__ import annotations

import re

from megarl.rewards import REWARDS

ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
TAIL_CHARS, BOXED_TAIL_CHARS = 300, 100

# Minerva's normalisation, applied in this order: text replaced, then text dropped
REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
           ",\\!", "{,}", '"', "\\dots")
# then, in order: the first $...$ of a line kept, wrappers unwrapped, shorthand fractions and roots braced
REWRITTEN = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r".*?\$(.*?)\$.*", r"$\1$"), (r"\\text\{(.*?)\}", r"\1"), (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"), (r"\\boxed\{(.*)\}", r"\1"), (r"frac([^{])(.)", r"frac{\1}{\2}"),
    (r"sqrt([^{])", r"sqrt{\1}"))]


def last_boxed(text: str) -> str | None:
    """What the last `\\boxed{...}` of `text` holds (its braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def normalize_final_answer(answer: str) -> str:
    answer = answer.split("=")[-1]
    for old, new in REPLACED:
        answer = answer.replace(old, new)
    for dropped in DROPPED:
        answer = answer.replace(dropped, "")
    for pattern, replacement in REWRITTEN:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_correct(response: str, answer: str) -> bool:
    tail = response[-TAIL_CHARS:]
    found = ANSWER.findall(tail)
    predicted = found[-1] if found else last_boxed(tail[-BOXED_TAIL_CHARS:])
    return predicted is not None and normalize_final_answer(predicted) == normalize_final_answer(answer)


@REWARDS.register("math_dapo")
def math_dapo_reward(response: str, answer: str, sample: dict) -> float:
    return 1.0 if dapo_correct(response, answer) else -1.0
