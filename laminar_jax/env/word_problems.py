"""Arithmetic word problems for the `calculator` environment, and synthetic tool-use traces.

A problem is a short story with one operation (x or +) on two one-digit numbers, e.g.

    question:   "7 boxes hold 6 pens each. How many pens?"
    expression: "7*6"            answer: 42

Every template has the same length and puts its numbers at the same characters, so the copy
from question to tool call is at a fixed distance, the easiest copy for a tiny model. The demo's
character model (2 layers, width 64) learns it in ~400 supervised steps; with two-digit numbers
at varying places it had not started to after 500. Every answer has two digits (operands whose
result has one are drawn again), so the copy from the tool message into the answer is at a fixed
distance too.

A tool trace is exactly what a successful episode looks like to the policy, as the list
[tool call, tool message, answer]: the tool message is the one the episode driver appends
(rendered by `render_tool_message`, so with the same tokenizer and template the trace and the
live episode agree token for token):

    ['<tool_call>{"name":"calculator","arguments":{"expression":"7*6"}}</tool_call>',
     'tool: 42\nassistant: ', 'Answer: 42']

The supervised warm-start (data/sft.py) trains on the turns only, the tool message being context.
A direct trace ['Answer: 42'] answers without the tool (mental arithmetic), exact or, with
`direct_spread` > 0, rough (['Answer: 41']: off by up to that much); `tool_share` sets how many
rows get a tool trace, so the warm-started policy sometimes calls the tool and sometimes does not,
and RL has a choice to learn.

`problem_rows` gives verl-layout rows (data_source 'calculator', extra_info.env 'calculator', the
answer as ground_truth) with the trace in a 'response' column, the layout data.source='file' reads
both as RL prompts and as supervised (prompt, response) pairs for the warm-start.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional

import numpy as np

from laminar_jax.env.calculator import evaluate, format_number
from laminar_jax.env.tools import TOOL_CALL_END, TOOL_CALL_START, render_tool_message

DATA_SOURCE = "calculator"
# (question, expression): one operation on two one-digit numbers, in the question's order; every
# question is 40 characters with its numbers at characters 0 and 13 (test_word_problems checks it).
TEMPLATES = (
    ("{a} boxes hold {b} pens each. How many pens?", "{a}*{b}"),
    ("{a} cards, and {b} more cards. How many now?", "{a}+{b}"),
)


class WordProblem(NamedTuple):
    question: str
    expression: str
    answer: str  # the value as format_number writes it (what the calculator returns)


def word_problem(rng: np.random.Generator) -> WordProblem:
    question, expression = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    while True:  # two-digit answers only: the copy from the tool message is at a fixed distance too
        a, b = (int(x) for x in rng.integers(2, 10, size=2))
        expr = expression.format(a=a, b=b)
        answer = format_number(evaluate(expr))
        if len(answer) == 2:
            return WordProblem(question.format(a=a, b=b), expr, answer)


def tool_call_text(expression: str) -> str:
    """The policy's tool call, compact JSON (fewer tokens for a character model)."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"


def tool_trace(problem: WordProblem, tokenizer: Optional[Any] = None,
               chat_template: Optional[str] = None) -> list[str]:
    """A successful episode as [policy turn, observation, policy turn]: tool call, tool message, answer.

    The supervised warm-start trains on the two turns only (data/sft.py): the tool message is
    context, as in RL.
    """
    observation = render_tool_message(problem.answer, tokenizer, chat_template)
    return [tool_call_text(problem.expression), observation, f"Answer: {problem.answer}"]


def direct_trace(problem: WordProblem, rng: Optional[np.random.Generator] = None, spread: int = 0) -> list[str]:
    """An answer without the tool (mental arithmetic): one policy turn, the value off by up to
    `spread` either way (uniformly, drawn from `rng`; exact when spread is 0)."""
    if spread == 0:
        return [f"Answer: {problem.answer}"]
    return [f"Answer: {format_number(float(problem.answer) + int(rng.integers(-spread, spread + 1)))}"]


def problem_rows(n: int, seed: int, tokenizer: Optional[Any] = None, chat_template: Optional[str] = None,
                 tool_share: float = 1.0, direct_spread: int = 0) -> list[dict]:
    """`n` verl-layout rows (deterministic in seed) with a supervised trace as 'response': a share
    `tool_share` of them (drawn at random) a tool trace, the others a direct answer off by up to
    `direct_spread` (`direct_trace`)."""
    if n < 1:
        raise ValueError(f"problem_rows: n={n} must be >= 1")
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"problem_rows: tool_share={tool_share} must be in [0, 1]")
    if direct_spread < 0:
        raise ValueError(f"problem_rows: direct_spread={direct_spread} must be >= 0")
    rng = np.random.default_rng([int(seed), 0xCA1C])
    rows = []
    for i in range(n):
        p = word_problem(rng)
        if rng.random() < tool_share:
            trace = tool_trace(p, tokenizer, chat_template)
        else:
            trace = direct_trace(p, rng, direct_spread)
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p.question}],
                     "reward_model": {"ground_truth": p.answer, "style": "rule"},
                     "extra_info": {"env": "calculator", "index": i, "expression": p.expression},
                     "response": trace})
    return rows


def write_problem_file(path: str, n: int, seed: int, tokenizer: Optional[Any] = None,
                       chat_template: Optional[str] = None, tool_share: float = 1.0, direct_spread: int = 0) -> str:
    """Write `problem_rows` as JSON lines at `path` unless a complete copy is there (atomic rename)."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        for row in problem_rows(n, seed, tokenizer, chat_template, tool_share, direct_spread):
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path
