"""`calculator`: arithmetic word problems solved with a calculator tool.

Each policy turn either calls the tool (Hermes format, see tools.py)

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7 + 3"}}</tool_call>

and gets the value back as a tool message, or answers. The episode ends at an answer (a turn
without a tool call) or after `max_turns` turns. Reward 1.0 when the last number of the answer
equals `ground_truth` (within 1e-6), else 0.0. Expressions are evaluated over an AST whitelist
(numbers, + - * / // % **, parentheses, unary minus), never with eval(); a bad expression gets
an error message as its tool result (the policy may retry), not a failed episode.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from laminar_jax.env.base import Environment, StepResult
from laminar_jax.env.tools import ToolCallError, parse_tool_calls

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression (ValueError on anything else, or exponents > 100)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        return ev(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


def answer_matches(text: str, ground_truth: Any) -> bool:
    nums = _NUMBER.findall(text)
    try:
        return bool(nums) and abs(float(nums[-1]) - float(ground_truth)) < 1e-6
    except (TypeError, ValueError):
        return False


class CalculatorEnv(Environment):
    def __init__(self, max_turns: int = 4):
        self.max_turns, self.turn, self.ground_truth = max_turns, 0, None
        self.tool_calls = 0

    def reset(self, prompt_record: dict) -> str:
        self.ground_truth, self.turn, self.tool_calls = prompt_record.get("ground_truth"), 0, 0
        return ""

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        try:
            calls = parse_tool_calls(action_text)
        except ToolCallError as e:
            calls, bad = [], str(e)
        else:
            bad = None
        if bad is None and not calls:
            return StepResult(None, float(answer_matches(action_text, self.ground_truth)), True)
        if self.turn >= self.max_turns:
            return StepResult(None, 0.0, True)
        if bad is not None:
            return StepResult(f"error: {bad}", 0.0, False)
        self.tool_calls += 1
        call = calls[0]
        if call.name != "calculator" or not isinstance(call.arguments.get("expression"), str):
            return StepResult(f"error: unknown tool {call.name!r} or missing 'expression'", 0.0, False)
        try:
            return StepResult(format_number(evaluate(call.arguments["expression"])), 0.0, False)
        except ValueError as e:
            return StepResult(f"error: {e}", 0.0, False)
