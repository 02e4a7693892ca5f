"""Countdown (as in TinyZero): reach a target with + - * / over given numbers, each used exactly once.

The reference answer is JSON: `{"target": 24, "numbers": [4, 7, 8, 8]}`. The response puts its equation
in `<answer>...</answer>` (the last such tag counts), e.g. `<answer>(8 - 4) * 7 - 8 + 4</answer>`.

  1.0  the equation uses exactly the given numbers and equals the target (exact rational arithmetic)
  0.1  an equation in the tags that does not (wrong value, wrong numbers, division by zero): format credit
  0.0  no `<answer>` tag, or something in it that is not an arithmetic expression

The expression is evaluated by walking its syntax tree, never with eval: only integers, + - * /, unary
minus and parentheses are accepted, so nothing in a response can run code or raise a huge power.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

from megarl.rewards import REWARDS

FORMAT_SCORE = 0.1
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
             ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


class NotAnEquation(ValueError):
    """The tagged text is not an arithmetic expression of the allowed form."""


def evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of an expression tree; the integer literals it uses are appended to `used`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, used)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left, used), evaluate(node.right, used))
    raise NotAnEquation(f"unsupported element {type(node).__name__}")


@REWARDS.register("countdown")
def countdown_reward(response: str, answer: str, sample: dict) -> float:
    reference = json.loads(answer)
    target, numbers = Fraction(reference["target"]), Counter(int(n) for n in reference["numbers"])
    tags = ANSWER_TAG.findall(response)
    if not tags:
        return 0.0
    equation = tags[-1].split("=")[0].strip()  # "3 + 4 = 7" is judged by its left side
    if not equation or len(equation) > MAX_EXPRESSION_CHARS or not re.fullmatch(r"[0-9+\-*/() .]+", equation):
        return 0.0
    try:
        used: list[int] = []
        value = evaluate(ast.parse(equation, mode="eval").body, used)
    except (SyntaxError, NotAnEquation):
        return 0.0
    except ZeroDivisionError:
        return FORMAT_SCORE
    return 1.0 if Counter(used) == numbers and value == target else FORMAT_SCORE
