"""Offline generation through the real engine and server loop (evaluation, tests, notebooks)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
from flax import nnx

from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.engine import Engine, make_engine
from laminar_jax.rollout.records import QueueFullError, Request
from laminar_jax.rollout.sampling import SamplingParams
from laminar_jax.rollout.server import RolloutServer


class Completion(NamedTuple):
    tokens: np.ndarray  # i32[R] generated ids (stop token included when finish_reason == 'eos')
    logprobs: np.ndarray  # f32[R] behaviour log-probs
    version: int
    finish_reason: str


def generate(model_or_params: Union[nnx.Module, tuple[Engine, Any]], prompts: Sequence[Sequence[int]],
             sampling: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None, *,
             section: Optional[RolloutSection] = None, seeds: Optional[Sequence[int]] = None,
             version: int = 0, timeout_s: float = 600.0) -> list[Completion]:
    """Complete every prompt; results in prompt order.

    model_or_params: a Transformer, or ``(engine, params)`` to reuse compiled programs.
    sampling: one SamplingParams for all, one per prompt, or None for the section defaults.
    seeds: per-prompt key seeds (default: the prompt index).
    """
    if isinstance(model_or_params, tuple):
        engine, params = model_or_params
    else:
        section = section or RolloutSection(max_prompt_len=max(len(p) for p in prompts),
                                            max_total_len=max(len(p) for p in prompts) + 256)
        engine, params = make_engine(model_or_params, section)
    server = RolloutServer(engine, params, version)
    per = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    if len(per) != len(prompts):
        raise ValueError(f"got {len(per)} sampling params for {len(prompts)} prompts")
    pending = [Request(uid=str(i), prompt_ids=list(p), seed=i if seeds is None else int(seeds[i]), sampling=per[i])
               for i, p in enumerate(prompts)]
    out: dict[int, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(prompts):
        while pending:
            try:
                server.submit(pending[0], timeout=0)
            except QueueFullError:
                break
            pending.pop(0)
        for t in server.step():
            out[int(t.uid)] = Completion(t.response_ids, t.behaviour_logprobs, t.version, t.finish_reason)
        if time.monotonic() > deadline:
            raise TimeoutError(f"offline generate: {len(out)}/{len(prompts)} done after {timeout_s}s")
    return [out[i] for i in range(len(prompts))]


__all__ = ["Completion", "generate"]
