"""bench engine --lora: serving a LoRA version merged into the weights at the swap, or unmerged in
the decode step (x @ W + scale * (x @ A) @ B per targeted projection), side by side.

    python launch/bench.py engine --lora [--preset tiny] [--rank 8] [--batch 16] [--context 128] [--reps 5]

merged: the plain model's engine; a swap refills every targeted stacked parameter a layer at a time
from the host's pristine base, merging the version's adapters into each layer on the device
(ParamPlacement.swap(lora=), the path servers run). unmerged: the engine of the model with adapters
attached (model/lora.py `attach`): the decode step reads the base and the adapters; a swap places
only the adapters. Decode: one generate() call at ``batch`` live slots of ``context`` tokens;
both engines timed in turn, ``reps`` rounds, medians. Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np

from laminar_jax.benchmarks.engine_profile import time_generate
from laminar_jax.benchmarks.machine import emit


def _decode_setup(engine, params, batch: int, context: int, max_new: int):
    from laminar_jax.rollout import SlotInit

    state = engine.init_decode_state()
    prompt = np.arange(context, dtype=np.int32) % 97 + 3
    pre = engine.prefill(params, *engine.schedule.pad_prompt(prompt))
    for slot in range(batch):
        state = engine.insert(pre, state, slot, SlotInit(np.zeros(2, np.uint32), 0.0, 0, 1.0, max_new, np.zeros(0)))
    return state


def _adapters(model, section, seed: int) -> dict:
    """Random (non-zero) adapters of every targeted weight, flat as published."""
    import jax

    from laminar_jax.model.lora import attach
    from laminar_jax.naming import path_name
    from flax import nnx

    lm = attach(model, section)
    rng = np.random.default_rng(seed)
    return {path_name(p): rng.normal(0, 0.02, x.shape).astype(np.float32)
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(lm, nnx.LoRAParam))[0]}


def _unmerged_swap(params, adapters: dict):
    """The unmerged engine's swap: only the adapter leaves are replaced (old ones deleted first)."""
    import jax

    from laminar_jax.naming import path_name

    def one(path, x):
        name = path_name(path)
        if name not in adapters:
            return x
        x.delete()
        return jax.device_put(adapters[name])

    out = jax.tree_util.tree_map_with_path(one, params)
    jax.block_until_ready(out)
    return out


def main(argv: list[str]) -> dict:
    import jax
    from flax import nnx

    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model.lora import LoRASection, attach
    from laminar_jax.model.lora_version import adapter_version, base_identity
    from laminar_jax.model.presets import PRESETS
    from laminar_jax.model.transformer import Transformer
    from laminar_jax.rollout import RolloutSection, make_engine
    from laminar_jax.runtime.fleet import params_from_flat
    from laminar_jax.weights.lora_base import ServedBase

    p = argparse.ArgumentParser(prog="bench engine --lora", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=20, help="generate() calls per timing")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    lsec = LoRASection(rank=args.rank, alpha=2.0 * args.rank)
    model = Transformer(PRESETS[args.preset], rngs=nnx.Rngs(0))
    page = 16
    sec = RolloutSection(num_slots=args.batch, page_size=page, max_prompt_len=args.context,
                         max_total_len=args.context + (args.iters + 1) * (args.reps + 1) + 2 * page,
                         prefill_buckets=(args.context,), decode_steps_per_call=1, temperature=0.0,
                         stop_token_ids=())
    sec = dataclasses.replace(sec, num_pages=args.batch * (-(-sec.max_total_len // page)) + 1)
    merged_engine, merged_params = make_engine(model, sec)
    lora_model = attach(model, lsec)
    unmerged_engine, unmerged_params = make_engine(lora_model, sec)
    # Own buffers: the merged swap refills its stacks in place (donated), and attach shares the arrays.
    unmerged_params = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), unmerged_params)
    base_flat = {k: np.array(v) for k, v in flatten_params(nnx.split(model)[1]).items()}
    base = ServedBase(base_flat, nnx.split(model)[1])
    stream = params_from_flat(model, merged_engine, stream=True, base=base)
    versions = [adapter_version(_adapters(model, lsec, s), base.id, lsec.scale) for s in range(args.reps + 1)]
    assert base.id == base_identity(base_flat)

    max_new = sec.max_total_len - args.context - 1
    states = {"merged": _decode_setup(merged_engine, merged_params, args.batch, args.context, max_new),
              "unmerged": _decode_setup(unmerged_engine, unmerged_params, args.batch, args.context, max_new)}
    params = {"merged": merged_params, "unmerged": unmerged_params}
    engines = {"merged": merged_engine, "unmerged": unmerged_engine}
    decode, swap = {"merged": [], "unmerged": []}, {"merged": [], "unmerged": []}
    for rep in range(args.reps + 1):  # round 0 compiles (swap programs included) and is dropped
        flat = versions[rep]
        hw = stream(flat)
        jax.block_until_ready(states["merged"])
        t0 = time.perf_counter()
        params["merged"] = merged_engine.placement.swap(params["merged"], hw.tree, lora=hw.lora)
        jax.block_until_ready(params["merged"])
        t_merged = time.perf_counter() - t0
        adapters = {k: v for k, v in flat.items() if k.endswith((".lora_a", ".lora_b"))}
        t0 = time.perf_counter()
        params["unmerged"] = _unmerged_swap(params["unmerged"], adapters)
        t_unmerged = time.perf_counter() - t0
        steps = {}
        for kind in ("merged", "unmerged"):
            steps[kind], states[kind] = time_generate(engines[kind], params[kind], states[kind], args.iters)
        if rep:
            swap["merged"].append(t_merged)
            swap["unmerged"].append(t_unmerged)
            for kind in steps:
                decode[kind].append(steps[kind])
    med = statistics.median
    # Medians, and minima: on a loaded machine the fastest round is the least disturbed one.
    res = {k: {"decode_step_s": med(decode[k]), "swap_s": med(swap[k]), "decode_step_min_s": min(decode[k]),
               "swap_min_s": min(swap[k])} for k in decode}
    print(f"{args.preset}, rank {args.rank}, {args.batch} slots x {args.context} tokens, {args.reps} rounds")
    print(f"{'kind':<9} {'decode step ms (med/min)':>24} {'swap ms (med/min)':>18}")
    for k, r in res.items():
        print(f"{k:<9} {r['decode_step_s'] * 1e3:11.3f} /{r['decode_step_min_s'] * 1e3:8.3f}   "
              f"{r['swap_s'] * 1e3:8.2f} /{r['swap_min_s'] * 1e3:7.2f}")
    ratio = res["unmerged"]["decode_step_s"] / res["merged"]["decode_step_s"]
    print(f"unmerged / merged decode step: {ratio:.3f}")
    return emit({"bench": "engine_lora", "preset": args.preset, "rank": args.rank, "batch": args.batch,
                 "context": args.context, "reps": args.reps, "iters": args.iters, **res,
                 "unmerged_vs_merged_decode": ratio, "decode_runs_s": decode, "swap_runs_s": swap,
                 "load_avg": list(os.getloadavg())})
