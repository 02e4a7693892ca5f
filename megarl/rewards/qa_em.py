"""Question answering by exact match (Search-R1's reward, verl's search_r1_like_qa_em scorer): 1.0 when the last
`<answer>...</answer>` of the response equals one of the reference targets, else 0.0.

Both sides are lower-cased, stripped of punctuation and of the articles a, an, the, and their whitespace collapsed:
`<answer> The Eiffel Tower. </answer>` matches `eiffel tower`. A right answer from a response with more than 10
`<answer>` or `</answer>` tags (an answer sprayed over many tags) scores 0.25. The reference is verl's ground truth
`{"target": [...]}`, or a list of targets, or one target string.
"""

from __future__ import annotations

import re
import string

from megarl.rewards import REWARDS

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = str.maketrans("", "", string.punctuation)
MAX_TAGS = 10


def normalize_text(text: str) -> str:
    return " ".join(ARTICLES.sub(" ", text.lower().translate(PUNCTUATION)).split())


def targets(answer) -> list[str]:
    if isinstance(answer, dict):
        if "target" not in answer:
            raise ValueError(f"question-answering reference {answer!r} has no 'target'")
        answer = answer["target"]
    return [answer] if isinstance(answer, str) else [str(t) for t in answer]


@REWARDS.register("qa_em")
def qa_exact_match(response: str, answer, sample: dict) -> float:
    found = ANSWER.findall(response)
    if not found:
        return 0.0
    predicted = normalize_text(found[-1].strip())
    if not any(normalize_text(target) == predicted for target in targets(answer)):
        return 0.0
    return 0.25 if max(response.count("<answer>"), response.count("</answer>")) > MAX_TAGS else 1.0
