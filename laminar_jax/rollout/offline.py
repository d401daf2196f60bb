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


def default_section(prompts: Sequence[Sequence[int]], per: Sequence[Optional[SamplingParams]]) -> RolloutSection:
    """The section generate() uses for a bare model: lengths rounded up to powers of two (so calls with
    similar prompts get equal shapes and reuse the compiled programs), 32 slots."""
    longest = max(len(p) for p in prompts)
    new = max(256 if sp is None else sp.max_new_tokens for sp in per)
    max_prompt = _pow2(max(longest, 16))
    total = _pow2(max_prompt + new)
    slots = min(32, _pow2(len(prompts)))
    page = 16
    return RolloutSection(num_slots=slots, page_size=page, max_prompt_len=max_prompt, max_total_len=total,
                          max_new_tokens=min(256, total - max_prompt),
                          num_pages=slots * -(-total // page) + 1, queue_capacity=len(prompts) + 1)


def per_prompt(sampling: Optional[Union[SamplingParams, Sequence[SamplingParams]]], n: int) -> list:
    """One SamplingParams (or None: the section defaults) per prompt, from one for all or a list of n."""
    per = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    if len(per) != n:
        raise ValueError(f"got {len(per)} sampling params for {n} prompts")
    return per


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def generate(model_or_params: Union[nnx.Module, tuple[Engine, Any]], prompts: Sequence[Sequence[int]],
             sampling: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None, *,
             section: Optional[RolloutSection] = None, seeds: Optional[Sequence[int]] = None,
             version: int = 0, timeout_s: float = 600.0) -> list[Completion]:
    """Complete every prompt; results in prompt order.

    model_or_params: a Transformer, or ``(engine, params)`` to reuse an engine (then ``section``, if
      given, must be that engine's section).
    sampling: one SamplingParams for all, one per prompt, or None for the section defaults.
    section: the engine geometry for a bare model; default: default_section() (32 slots, lengths
      rounded to powers of two, so repeated calls reuse the compiled programs).
    seeds: per-prompt key seeds (default: the prompt index).
    """
    if not prompts:
        return []
    per = per_prompt(sampling, len(prompts))
    if isinstance(model_or_params, tuple):
        engine, params = model_or_params
        if section is not None and section != engine.section:
            raise ValueError("generate(section=...) differs from the passed engine's section; build the engine "
                             "with that section (make_engine) or drop section=")
    else:
        engine, params = make_engine(model_or_params, section or default_section(prompts, per))
    return complete(RolloutServer(engine, params, version), prompts, per, seeds=seeds, timeout_s=timeout_s)


def complete(server: RolloutServer, prompts: Sequence[Sequence[int]], per: Sequence[Optional[SamplingParams]], *,
             seeds: Optional[Sequence[int]] = None, timeout_s: float = 600.0) -> list[Completion]:
    """Run every prompt (one SamplingParams or None each) to completion on an idle ``server``,
    stepping it in this thread; results in prompt order. An owner may keep the server (and its KV
    pools) for the next call: it holds no sequence afterwards, at most the last generate() step, still
    in flight, which the next call reads first. After an exception it may hold leftovers."""
    if server.num_live or server.stats().queue_length:
        raise RuntimeError("offline complete(): the server still holds sequences from an earlier call")
    if not server.idle() and server.step():  # the earlier call's last step: rows of finished sequences only
        raise RuntimeError("offline complete(): the server's step in flight finished sequences of an earlier call")
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


__all__ = ["Completion", "complete", "default_section", "generate", "per_prompt"]
