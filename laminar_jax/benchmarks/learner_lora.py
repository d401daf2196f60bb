"""bench learner --lora: learner state bytes and published bytes per version, LoRA against full fine-tuning.

Measured: two real learners on the demo model (configs/demo.py), full fine-tuning and learner.lora at
``--rank``: bytes of their live state (trained params, AdamW moments, the gradients one update
holds, the frozen base) and the median time of a step on synthetic trajectories. Planned: the same
items for the 7B config (configs/gpu_node.py) from the memory planner (placement_memory: per learner
device, and whole-model totals), and the bytes one published version carries: the whole model in
rollout.dtype against the adapters (float32, as trained). Goal: adapters <= 2% of the whole at rank 16.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import jax
import numpy as np

from laminar_jax.benchmarks.machine import emit

GOAL = 0.02


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _with_lora(cfg, rank: int):
    from laminar_jax.model.lora import LoRASection

    section = LoRASection(rank=rank, alpha=2.0 * rank)
    return dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, lora=section))


def _trajectories(n: int, seq: int, vocab: int, group: int) -> list:
    """Random scored trajectories of ``seq`` tokens in groups of ``group`` (a quarter prompt)."""
    from laminar_jax.types import Trajectory

    rng, p = np.random.default_rng(0), max(1, seq // 4)
    return [Trajectory(f"b{i // group}/{i % group}", f"b{i // group}", i % group,
                       rng.integers(3, vocab, p).astype(np.int32), rng.integers(3, vocab, seq - p).astype(np.int32),
                       np.full(seq - p, -np.log(vocab), np.float32), 0, reward=float(rng.random())) for i in range(n)]


def measured(rank: int, steps: int) -> dict:
    """Live learner state bytes (and step time) on the demo model, full fine-tuning vs LoRA."""
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.learner import Learner
    from laminar_jax.model import build_model

    cfg = finalize(repo_config("demo"))
    out = {}
    for name, c in (("full", cfg), ("lora", _with_lora(cfg, rank))):
        section = dataclasses.replace(c.learner, seq_len_buckets=(64,), pack_length=0, checkpoint_dir=None)
        learner = Learner(section, build_model(c.model), publish_dtype=c.rollout.dtype)
        st = learner.state
        trained = _bytes(st.params)
        items = {"trained_params": trained, "adam_moments": _bytes(st.opt_state), "gradients": trained,
                 "frozen_base": _bytes(st.frozen)}
        trajs = _trajectories(8, 64, 100, 4)
        learner.step(trajs)  # compile
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            learner.step(trajs)
            times.append(time.perf_counter() - t0)
        learner.close()
        out[name] = {"items": items, "state_bytes": sum(items.values()), "step_s": float(np.median(times))}
    out["state_ratio"] = out["lora"]["state_bytes"] / out["full"]["state_bytes"]
    return out


def planned(config: str, rank: int, accelerator: str, devices: int) -> dict:
    """The memory plan's learner items for ``config`` (full and LoRA) and the bytes of one published version."""
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.placement_memory import (arch_of, itemsize, lora_table, param_table, report, serving_dtype)

    cfg = finalize(repo_config(config))
    lcfg = _with_lora(cfg, rank)
    arch = arch_of(cfg)
    out = {"config": config, "preset": cfg.model.preset, "accelerator": accelerator, "devices": devices}
    for name, c in (("full", cfg), ("lora", lcfg)):
        r = report(c, accelerator, devices)
        learner_row = next(row for row in r["rows"] if "learner" in row["role"])
        state = {k: learner_row["items"].get(k, 0) for k in ("master_params", "adam_moments", "gradients",
                                                               "ref_params", "frozen_base")}
        out[name] = {"learner_state_gb_per_device": sum(state.values()) / 1e9,
                     "items_gb": {k: v / 1e9 for k, v in state.items()}, "worst_gb": r["worst_gb"], "fits": r["fits"]}
    params = sum(math.prod(s) for s, _ in param_table(arch))
    adapters = sum(math.prod(s) for s, _ in lora_table(arch, rank, tuple(lcfg.learner.lora.targets)))
    s = itemsize(serving_dtype(cfg))
    full_version, adapter_version = params * s, adapters * 4
    # Whole-model learner state: f32 master + two f32 moments + f32 gradients of what trains, and the frozen base.
    out.update(params=params, adapter_params=adapters, full_state_gb=16 * params / 1e9,
               lora_state_gb=(16 * adapters + s * params) / 1e9,
               publish_bytes_full=full_version, publish_bytes_lora=adapter_version,
               publish_ratio=adapter_version / full_version, publish_ratio_serving_dtype=adapters * s / full_version)
    out["state_ratio"] = out["lora_state_gb"] / out["full_state_gb"]
    out["goal_met"] = out["publish_ratio"] <= GOAL
    return out


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench learner --lora")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plan-config", default="gpu_node", help="configs/<name>.py planned (default: the 7B node)")
    ap.add_argument("--accelerator", default="h100")
    ap.add_argument("--devices", type=int, default=8)
    args, _ = ap.parse_known_args(argv)
    demo = measured(args.rank, args.steps)
    plan = planned(args.plan_config, args.rank, args.accelerator, args.devices)
    print(f"demo model, live learner state: full {demo['full']['state_bytes'] / 1e6:.2f} MB, "
          f"LoRA r={args.rank} {demo['lora']['state_bytes'] / 1e6:.2f} MB ({demo['state_ratio']:.1%}); "
          f"step {demo['full']['step_s'] * 1e3:.0f} ms vs {demo['lora']['step_s'] * 1e3:.0f} ms")
    full_gb, lora_gb = (plan[k]["learner_state_gb_per_device"] for k in ("full", "lora"))
    print(f"{plan['preset']} plan ({args.devices} x {args.accelerator}): learner state per learner device "
          f"{full_gb:.1f} GB full vs {lora_gb:.1f} GB LoRA; whole {plan['full_state_gb']:.1f} GB vs "
          f"{plan['lora_state_gb']:.1f} GB ({plan['state_ratio']:.1%})")
    print(f"published per version: full {plan['publish_bytes_full'] / 1e9:.2f} GB, adapters "
          f"{plan['publish_bytes_lora'] / 1e6:.1f} MB = {plan['publish_ratio']:.2%} (goal <= {GOAL:.0%}: "
          f"{'met' if plan['goal_met'] else 'NOT met'})")
    return emit({"bench": "learner_lora", "rank": args.rank, "device": jax.devices()[0].device_kind,
                 "demo": demo, "plan": plan})
