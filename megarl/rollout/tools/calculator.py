"""`calculator`: arithmetic on numbers, evaluated over Python's ast (never eval).

Allowed: int and float literals, + - * / // % ** (unary + and - too), parentheses, the constants pi
and e, and the functions in FUNCTIONS. Anything else (names, attributes, strings, comprehensions,
`^`) is an error naming what is not allowed. Sizes are bounded so a call cannot hang its thread:
an expression of at most MAX_CHARS characters, integers of at most MAX_INT_BITS bits at every step.
"""

from __future__ import annotations

import ast
import math
import operator

from megarl.rollout.tools import TOOLS, Tool, ToolError

MAX_CHARS = 256
MAX_INT_BITS = 4096
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "log": math.log,
             "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan, "floor": math.floor,
             "ceil": math.ceil}
CONSTANTS = {"pi": math.pi, "e": math.e}


def evaluate(expression: str) -> int | float:
    if len(expression) > MAX_CHARS:
        raise ToolError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse the expression: {e.msg}") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as e:
        raise ToolError(f"math error: {e}") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * max(abs(left).bit_length() - 1, 1) > MAX_INT_BITS:
                raise ToolError(f"the result is too large (over {MAX_INT_BITS} bits)")
        return _bounded(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        return _bounded(FUNCTIONS[node.func.id](*[_eval(a) for a in node.args]))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not allowed (write powers as **)")
    raise ToolError(f"'{ast.unparse(node)[:60]}' is not allowed; use numbers, + - * / // % **, parentheses, pi, e and "
                    f"{', '.join(FUNCTIONS)}")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"the result is too large (over {MAX_INT_BITS} bits)")
    if isinstance(value, complex):
        raise ToolError("the result is a complex number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"the result is not finite ({value})")
    return value


def format_number(value: int | float) -> str:
    """Integers as integers (also integral floats below 1e15, so 6/3 reads "2"), other floats by repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


@TOOLS.register("calculator")
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. (12 + 7) * 3 / 4 or sqrt(2) ** 3."
    parameters = {"type": "object", "properties": {"expression": {"type": "string",
                                                                  "description": "the expression"}},
                  "required": ["expression"]}

    def run(self, expression: str) -> str:
        if not isinstance(expression, str):
            raise ToolError("'expression' must be a string")
        return format_number(evaluate(expression))
