"""`python`: the policy runs code in the sandbox (sandbox.py) through a `python` tool.

    <tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>

The tool message is the run's stdout (and, when it did not end ok, its status and the last
stderr line). The episode ends at an answer (a turn without a tool call; reward 1.0 when its last
number equals ground_truth) or after max_turns. Each episode has its own scratch directory.

sandbox='bwrap' (the default) isolates each run with bubblewrap and refuses to build the
environment when bwrap is missing or cannot create namespaces (bwrap.SandboxUnavailable says how to
fix it); sandbox='none' runs the code in the trainer's own user and namespaces (env.sandbox).
"""

from __future__ import annotations

from typing import Optional

from laminar_jax.env.base import Environment, StepResult
from laminar_jax.env.calculator import answer_matches
from laminar_jax.env.bwrap import check_sandbox
from laminar_jax.env.sandbox import SandboxLimits, Scratch, run_python
from laminar_jax.env.tools import ToolCallError, parse_tool_calls


class PythonEnv(Environment):
    def __init__(self, max_turns: int = 4, cpu_s: int = 5, memory_mb: int = 512, wall_s: float = 10.0,
                 scratch_root: Optional[str] = None, sandbox: str = "bwrap"):
        check_sandbox(sandbox)
        self.max_turns, self.scratch_root, self.sandbox = max_turns, scratch_root, sandbox
        self.limits = SandboxLimits(cpu_s=cpu_s, memory_bytes=memory_mb << 20, wall_s=wall_s)
        self.turn, self.ground_truth, self.scratch, self.runs = 0, None, None, []

    def reset(self, prompt_record: dict) -> str:
        self.close()
        self.turn, self.ground_truth, self.runs = 0, prompt_record.get("ground_truth"), []
        self.scratch = Scratch(self.scratch_root)
        return ""

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        try:
            calls = parse_tool_calls(action_text)
        except ToolCallError as e:
            return StepResult(None, 0.0, True) if self.turn >= self.max_turns else StepResult(f"error: {e}", 0.0, False)
        if not calls:
            return StepResult(None, float(answer_matches(action_text, self.ground_truth)), True)
        if self.turn >= self.max_turns:
            return StepResult(None, 0.0, True)
        call = calls[0]
        if call.name != "python" or not isinstance(call.arguments.get("code"), str):
            return StepResult(f"error: unknown tool {call.name!r} or missing 'code'", 0.0, False)
        res = run_python(call.arguments["code"], self.scratch.path, self.limits, self.sandbox)
        self.runs.append(res)
        obs = res.stdout if res.status == "ok" else f"{res.stdout}\n[{res.status}: {res.detail}]"
        return StepResult(obs.strip() or "(no output)", 0.0, False)

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None
