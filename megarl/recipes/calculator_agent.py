"""A calculator-using agent written only against the `openai` client, as a user's agent is (docs/agents.md):
configs/gateway_calculator.yaml trains the policy through it (agent.gateway.function).

It asks the policy for an answer, with a calculator offered as an OpenAI tool; each tool call is computed here and
sent back as a tool message, for at most three model turns. Its reward mirrors the built-in agent loop's
tool_answer: 0.5 when a calculator result was the answer, 0.5 when the final answer is.
"""

from __future__ import annotations

import ast
import json
import operator

from openai import OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 37*58.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """+ - * / on numbers; anything else is an error message for the model."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * /")
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def agent(base_url: str, api_key: str, row: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, results = [{"role": "user", "content": row["prompt"]}], []
    for _ in range(3):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                 max_tokens=90).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(str(json.loads(call.function.arguments).get("expression", "")))
            except (json.JSONDecodeError, AttributeError):
                result = "error: the arguments are not a JSON object"
            results.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (messages[-1].get("content") or "").strip() if messages[-1]["role"] == "assistant" else ""
    return 0.5 * (row["answer"] in results) + 0.5 * (answer == row["answer"])
