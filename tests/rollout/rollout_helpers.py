"""Shared fixtures for the rollout tests: a tiny model, servers, and a run-to-completion loop."""

from __future__ import annotations

import functools

import numpy as np
import jax
from flax import nnx

from laminar_jax.model import PRESETS, Transformer
from laminar_jax.rollout import Request, RolloutSection, RolloutServer, SamplingParams, make_engine

SECTION = RolloutSection(num_slots=4, page_size=8, num_pages=40, max_prompt_len=16, max_total_len=64,
                         max_new_tokens=24, prefill_buckets=(16,), temperature=1.0, stop_token_ids=())


@functools.lru_cache(maxsize=4)
def tiny_model(seed: int = 0) -> Transformer:
    return Transformer(PRESETS["tiny"], rngs=nnx.Rngs(seed))


def make_server(section: RolloutSection = SECTION, seed: int = 0, version: int = 0) -> RolloutServer:
    engine, params = make_engine(tiny_model(seed), section)
    return RolloutServer(engine, jax.tree.map(lambda x: x.copy(), params), version)  # owned (params_of)


def params_of(seed: int):
    """A copy of the cached model's params: a server that owns its weights deletes them at a swap,
    which must not reach the cached model other tests read."""
    return jax.tree.map(lambda x: x.copy(), nnx.split(tiny_model(seed))[1])


def request(i: int, max_new: int = 12, prompt_len: int = 5, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0, stop=()) -> Request:
    rng = np.random.default_rng(i)
    prompt = [1] + rng.integers(3, 100, size=prompt_len - 1).tolist()
    return Request(uid=f"p{i}/0", prompt_ids=prompt, prompt_uid=f"p{i}", seed=1000 + i,
                   sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                           max_new_tokens=max_new, stop_token_ids=tuple(stop)))


def run_until(server: RolloutServer, n: int, max_steps: int = 2000) -> dict:
    """Step until n trajectories have finished; {uid: Trajectory}."""
    out = {}
    for _ in range(max_steps):
        for t in server.step():
            out[t.uid] = t
        if len(out) >= n:
            return out
    raise AssertionError(f"only {len(out)}/{n} finished after {max_steps} steps: {server.stats()}")


def layer_pools(pool, num_layers: int, layout: str = "split", key: bool = True) -> list:
    """A decode state's one pool of every layer's pages (rollout/layered.py) as each layer's own pages
    (in the pool's ``layout``: its page axis is where that layout puts it)."""
    from laminar_jax.rollout.attention import page_axis

    return np.split(np.asarray(pool), num_layers, axis=page_axis(layout, key=key))
