"""The Environment interface a multi-turn episode talks to, and what one step returns.

An episode: `reset(prompt_record)` once (the first observation, text appended after the prompt;
"" for none), then `step(action_text)` after each policy turn, until `done`. Observations are
rendered into tokens by the rollout side (tools.render_tool_message) and are context only.
Environments run in the EnvPool, never on the rollout server's thread.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional


class StepResult(NamedTuple):
    observation: Optional[str]  # text shown to the policy next turn (None: nothing; the episode ends)
    reward: float  # reward of this step; the episode's reward is the sum over its steps
    done: bool


class MalformedStepError(ValueError):
    """An environment returned something that is not a StepResult-shaped (obs|None, reward, done)."""


class Environment:
    """Subclass and override `reset` and `step`. One instance serves one episode."""

    def reset(self, prompt_record: dict[str, Any]) -> str:
        """The first observation ("" when the prompt says it all)."""
        return ""

    def step(self, action_text: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (scratch dirs, subprocesses)."""


def check_step(value: Any, env_name: str) -> StepResult:
    """Validate what `step` returned: (observation str|None, finite reward, bool done)."""
    if not (isinstance(value, tuple) and len(value) == 3):
        raise MalformedStepError(f"env {env_name!r}: step must return (observation, reward, done), got {value!r:.200}")
    obs, reward, done = value
    if obs is not None and not isinstance(obs, str):
        raise MalformedStepError(f"env {env_name!r}: observation must be str or None, got {type(obs).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise MalformedStepError(f"env {env_name!r}: reward must be a finite number, got {reward!r:.100}")
    if not isinstance(done, bool):
        raise MalformedStepError(f"env {env_name!r}: done must be a bool, got {done!r:.100}")
    return StepResult(obs, float(reward), done or obs is None)


def check_reset(value: Any, env_name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedStepError(f"env {env_name!r}: reset must return str or None, got {type(value).__name__}")
    return value
