"""`latency`: a synthetic environment for benchmarks: fixed turns, log-normal latency per step.

Each step sleeps a log-normal time (median `median_s`, log-space sigma `sigma`; the preset
median is 3 s) from a generator seeded by (seed, prompt uid), so runs are repeatable, and ends the
episode after `turns` policy turns. Latency comes from the environment, not from compute, which
is what trajectory-level asynchrony can overlap. Reward: the share of turns whose action is
non-empty, scaled by `reward_scale` (a signal that does not depend on tools).
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from laminar_jax.env.base import Environment, StepResult

# The simulator's `agentic` preset (sim/workload.py) models this environment's latency with these
# two figures; the environment does not import the simulator, and tests/env/test_env_plane.py
# checks that both say the same.
MEDIAN_PRESET_S = 3.0
SIGMA_PRESET = 0.8


def sample_latency(rng: np.random.Generator, median_s: float, sigma: float) -> float:
    """The simulator's law (laminar_jax.sim.workload.env_latency): median * exp(sigma * z)."""
    return float(median_s * np.exp(sigma * rng.standard_normal())) if median_s > 0 else 0.0


class LatencyEnv(Environment):
    def __init__(self, turns: int = 3, median_s: float = MEDIAN_PRESET_S, sigma: float = SIGMA_PRESET, seed: int = 0,
                 observation: str = " ok ", reward_scale: float = 1.0):
        if turns < 1 or median_s < 0 or sigma < 0:
            raise ValueError(f"latency env: turns={turns} >= 1, median_s={median_s} >= 0, sigma={sigma} >= 0")
        self.turns, self.median_s, self.sigma, self.seed = turns, median_s, sigma, seed
        self.observation, self.reward_scale = observation, reward_scale
        self.turn, self.nonempty, self.rng = 0, 0, np.random.default_rng(seed)

    def reset(self, prompt_record: dict) -> str:
        key = f"{self.seed}/{prompt_record.get('uid', '')}".encode()
        self.rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
        self.turn = self.nonempty = 0
        return ""

    def step(self, action_text: str) -> StepResult:
        time.sleep(sample_latency(self.rng, self.median_s, self.sigma))
        self.turn += 1
        self.nonempty += int(bool(action_text.strip()))
        if self.turn >= self.turns:
            return StepResult(None, self.reward_scale * self.nonempty / self.turns, True)
        return StepResult(self.observation, 0.0, False)
