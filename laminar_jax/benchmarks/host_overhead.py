"""Host overhead of decoding: what a generate() call costs the host, with compute made negligible.

``python launch/bench.py engine --host-overhead``: a one-layer model of width 32 (its decode step is
microseconds of compute), a server with every slot live on forced-length requests, run to the end
at ``rollout.decode_steps_per_call`` = 1 and at the accelerators' default (schedule.py,
AUTO_STEPS_ACCELERATOR), alternating, medians of ``--repeats`` runs. Per setting:

- ``host_ms_per_call``: wall time of the server loop per generate() call (dispatch, the host's read of
  the call's tokens, bookkeeping, admissions); with negligible compute this is the host's cost;
- ``host_us_per_token``: the same wall time per generated token;
- ``cpu_us_per_token``: this process's CPU time per generated token;
- ``calls_per_token``: generate() calls (device round trips) per generated token.

On an accelerator every call is a host round trip that the device waits through, so fewer calls
per token is what several steps per call buy; on this CPU the figure shows the host's share alone.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from laminar_jax.rollout.schedule import AUTO_STEPS_ACCELERATOR


def tiny_config():
    from laminar_jax.model.arch import TransformerConfig

    return TransformerConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16, max_position_embeddings=512)


def _run(model, section, prompts: list, max_new: int) -> dict:
    from laminar_jax.rollout import Request, RolloutServer, SamplingParams, make_engine
    from laminar_jax.rollout.warmup import warmup

    engine, params = make_engine(model, section)
    warmup(engine, params)
    calls = [0]
    generate = engine.generate

    def counted(*a, **k):
        calls[0] += 1
        return generate(*a, **k)

    engine.generate = counted  # this bench's own engine: counts its device calls

    def serve(tag: str, n_new: int) -> tuple[float, float, int]:
        server = RolloutServer(engine, params)
        for i, p in enumerate(prompts):
            server.submit(Request(uid=f"{tag}{i}", prompt_ids=p, seed=i,
                                  sampling=SamplingParams(temperature=0.0, max_new_tokens=n_new, stop_token_ids=())))
        t0, c0, tokens, done = time.perf_counter(), time.process_time(), 0, 0
        while done < len(prompts):
            for t in server.step():
                done += 1
                tokens += len(t.response_ids)
        return time.perf_counter() - t0, time.process_time() - c0, tokens

    serve("w", 2 * section.decode_steps_per_call)  # every program compiled and run once
    calls[0] = 0
    wall, cpu, tokens = serve("r", max_new)
    if tokens != len(prompts) * max_new:
        raise RuntimeError(f"generated {tokens} tokens, expected {len(prompts) * max_new}")
    return {"steps_per_call": section.decode_steps_per_call, "generate_calls": calls[0], "tokens": tokens,
            "host_ms_per_call": wall / calls[0] * 1e3, "host_us_per_token": wall / tokens * 1e6,
            "cpu_us_per_token": cpu / tokens * 1e6, "calls_per_token": calls[0] / tokens}


def run(slots: int = 8, max_new: int = 64, repeats: int = 3, steps: tuple[int, ...] = (1, AUTO_STEPS_ACCELERATOR)) -> dict:
    """Medians over ``repeats`` alternating runs of each steps-per-call setting."""
    import jax
    from flax import nnx

    from laminar_jax.model import Transformer
    from laminar_jax.rollout import RolloutSection

    model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, size=12).tolist() for _ in range(slots)]
    base = RolloutSection(num_slots=slots, page_size=16, num_pages=slots * 6 + 1, max_prompt_len=16,
                          max_total_len=16 + max_new + 16, max_new_tokens=max_new, prefill_buckets=(16,),
                          temperature=0.0, stop_token_ids=(), queue_capacity=slots + 1)
    runs: dict = {k: [] for k in steps}
    for _ in range(repeats):
        for k in steps:
            runs[k].append(_run(model, dataclasses.replace(base, decode_steps_per_call=k), prompts, max_new))
    fields = ("host_ms_per_call", "host_us_per_token", "cpu_us_per_token", "calls_per_token")
    per = {str(k): {f: round(float(np.median([r[f] for r in rs])), 4) for f in fields}
           | {"generate_calls": rs[0]["generate_calls"], "tokens": rs[0]["tokens"]} for k, rs in runs.items()}
    lo, hi = str(steps[0]), str(steps[-1])
    return {"bench": "engine_host_overhead", "device": jax.devices()[0].platform, "slots": slots,
            "max_new_tokens": max_new, "repeats": repeats, "per_steps_per_call": per,
            "host_us_per_token_ratio": round(per[hi]["host_us_per_token"] / per[lo]["host_us_per_token"], 4),
            "calls_per_token_ratio": round(per[hi]["calls_per_token"] / per[lo]["calls_per_token"], 4)}
