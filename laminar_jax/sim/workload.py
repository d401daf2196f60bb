"""Synthetic RL workloads: heavy-tailed response lengths, GRPO groups, multi-turn environments.

Lengths are log-normal. A prompt's samples share part of their log-length (hard prompts give long
answers to every sample): log L = log median + sigma·(sqrt(rho)·z_prompt + sqrt(1-rho)·z_sample),
so the marginal is still LogNormal(log median, sigma) and p99/median = exp(2.326·sigma).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A workload preset.

    Attributes:
      name: Preset name.
      response_median: Median response tokens (all turns together for multi-turn).
      p99_over_median: Response p99 / median (sets the log-normal sigma).
      max_response: Responses are clipped here.
      prompt_median: Median prompt tokens.
      prompt_sigma: Log-normal sigma of prompt lengths.
      max_prompt: Prompts are clipped here.
      group_corr: Fraction of the log-length variance shared by a prompt's samples.
      turns_min: Fewest turns per trajectory (1 = single-turn).
      turns_max: Most turns per trajectory.
      env_latency_median_s: Median environment (tool / sandbox) latency between turns.
      env_latency_sigma: Log-normal sigma of the environment latency.
      obs_tokens: Tokens the environment appends per turn (prefilled before the next turn).
      reward_latency_s: Time from a trajectory's last token to its reward being written.
    """

    name: str
    response_median: float
    p99_over_median: float
    max_response: int
    prompt_median: float
    prompt_sigma: float
    max_prompt: int
    group_corr: float = 0.5
    turns_min: int = 1
    turns_max: int = 1
    env_latency_median_s: float = 0.0
    env_latency_sigma: float = 0.0
    obs_tokens: int = 0
    reward_latency_s: float = 0.5

    @property
    def sigma(self) -> float:
        return math.log(self.p99_over_median) / Z99


PRESETS: dict[str, WorkloadSpec] = {
    # Math RL (DAPO-Math-like): p99 = 10x median, tail to 16K, prompts <= 2K.
    "math": WorkloadSpec("math", response_median=1500, p99_over_median=10.0, max_response=16384,
                         prompt_median=300, prompt_sigma=0.5, max_prompt=2048),
    # Multi-turn tool calling with a code sandbox: 2-8 turns, seconds of environment latency per turn.
    # The `latency` environment (laminar_jax/env/latency.py) takes its median and sigma from here.
    "agentic": WorkloadSpec("agentic", response_median=2000, p99_over_median=8.0, max_response=16384,
                            prompt_median=800, prompt_sigma=0.4, max_prompt=2048, turns_min=2, turns_max=8,
                            env_latency_median_s=3.0, env_latency_sigma=0.8, obs_tokens=200,
                            reward_latency_s=1.0),
    # No length skew: every response has exactly the median length (sanity checks).
    "uniform": WorkloadSpec("uniform", response_median=1500, p99_over_median=1.0, max_response=16384,
                            prompt_median=300, prompt_sigma=0.0, max_prompt=2048),
}


class Samples(NamedTuple):
    """Lengths for n_prompts · samples_per_prompt trajectories, prompt-major."""

    prompt_len: np.ndarray  # i64[N]
    response_len: np.ndarray  # i64[N] all turns together
    turns: np.ndarray  # i64[N]


def workload(name: str) -> WorkloadSpec:
    if name not in PRESETS:
        raise ValueError(f"sim.workload={name!r}: must be one of {sorted(PRESETS)}")
    return PRESETS[name]


def sample(spec: WorkloadSpec, n_prompts: int, samples_per_prompt: int, rng: np.random.Generator) -> Samples:
    """Draw lengths for ``n_prompts`` groups of ``samples_per_prompt`` (see module docstring)."""
    k = samples_per_prompt
    s, rho = spec.sigma, spec.group_corr
    zp = np.repeat(rng.standard_normal(n_prompts), k)
    zs = rng.standard_normal(n_prompts * k)
    log_len = math.log(spec.response_median) + s * (math.sqrt(rho) * zp + math.sqrt(1 - rho) * zs)
    resp = np.clip(np.round(np.exp(log_len)), 1, spec.max_response).astype(np.int64)
    plog = math.log(spec.prompt_median) + spec.prompt_sigma * rng.standard_normal(n_prompts)
    prompt = np.repeat(np.clip(np.round(np.exp(plog)), 1, spec.max_prompt).astype(np.int64), k)
    turns = rng.integers(spec.turns_min, spec.turns_max + 1, size=n_prompts * k).astype(np.int64)
    turns = np.minimum(turns, resp)
    return Samples(prompt, resp, turns)


def env_latency(spec: WorkloadSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Environment latencies (s) for n turn boundaries."""
    if n == 0 or spec.env_latency_median_s <= 0:
        return np.zeros(n)
    return spec.env_latency_median_s * np.exp(spec.env_latency_sigma * rng.standard_normal(n))
