"""How a packed learner step draws its mini-batches and rounds its rows, timed side by side
(`python launch/bench.py learner --packing [--quick] [--steps 80]`).

The RL loop's batches are long-tailed: a GRPO group of the skewed task shares one prompt and about
one response length, and a few groups are ten times the median. Packed, every mini-batch of a step
has the row count of its fullest one (the updates are one scan), rounded up to a row bucket, so a
step's padding depends on how its trajectories are dealt into mini-batches and on the buckets.
This runs the demo's learner (its model preset and section: 8 prompts x 8 samples, 4 updates a
step, rows of `rollout.max_total_len` tokens) on the `synthetic_skew` task's own prompt and
response lengths, under each (`learner.mini_batch_draw`, `learner.pack_rows_per_doubling`) pair:

    random / 1       consecutive parts of a random order, power-of-two row counts (the old default)
    stratified / 1   dealt by length, one of each stratum to each mini-batch; powers of two
    stratified / 2   the same, with the midpoints (3, 6, 12 rows ...): the default

One learner per variant in one process, the same batches, steps interleaved round-robin so the
machine's drift falls on all alike. Prints rows per step, the share of row positions that hold a
token (fill), wall and CPU per step (mean, median, spread), the warm-up's shapes and seconds, and
each variant against `random / 1`; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Sequence

import numpy as np

from laminar_jax.benchmarks.machine import emit
from laminar_jax.data.synthetic_skew import SkewTask, sample_problem
from laminar_jax.types import Trajectory

VARIANTS = (("random", 1), ("stratified", 1), ("stratified", 2))


def skew_batches(batches: int, prompts: int, samples: int, seed: int = 0) -> list[list[Trajectory]]:
    """Scored trajectories with the skewed task's lengths: a prompt of its characters plus BOS,
    a response of the target plus EOS, `samples` per prompt (random token ids: only the lengths
    shape a packed step's cost)."""
    task, rng, out = SkewTask(), np.random.default_rng(seed), []
    for b in range(batches):
        trajs = []
        for g in range(prompts):
            p = sample_problem(task, seed, b * prompts + g)
            n_prompt, n_resp = len(p.prompt) + 1, len(p.target) + 1
            for i in range(samples):
                trajs.append(Trajectory(f"b{b}p{g}/{i}", f"b{b}p{g}", i, rng.integers(3, 60, n_prompt),
                                        rng.integers(3, 60, n_resp), rng.normal(-2, 0.3, n_resp).astype(np.float32),
                                        0, reward=float(rng.random())))
        out.append(trajs)
    return out


def _spread(xs: Sequence[float]) -> dict:
    a = 1e3 * np.asarray(xs)
    return {"mean": round(float(a.mean()), 1), "median": round(float(np.median(a)), 1),
            "p10": round(float(np.percentile(a, 10)), 1), "p90": round(float(np.percentile(a, 90)), 1)}


def run(steps: int, batches: int = 40) -> dict:
    from laminar_jax.benchmarks.e2e import demo_config
    from laminar_jax.config import finalize
    from laminar_jax.learner.learner import Learner
    from laminar_jax.model import build_model

    cfg = finalize(demo_config())
    rt = cfg.runtime
    data = skew_batches(batches, rt.prompts_per_step, rt.samples_per_prompt)
    learners, warm = {}, {}
    for draw, per in VARIANTS:
        name = f"{draw}/{per}"
        section = dataclasses.replace(cfg.learner, mini_batch_draw=draw, pack_rows_per_doubling=per)
        learners[name] = Learner(section, build_model(cfg.model))
        t0 = time.perf_counter()
        shapes = learners[name].warmup(rt.prompts_per_step * rt.samples_per_prompt, cfg.rollout.max_total_len)
        warm[name] = {"shapes": shapes, "s": round(time.perf_counter() - t0, 1)}
    wall = {k: [] for k in learners}
    cpu = {k: [] for k in learners}
    rows = {k: [] for k in learners}
    tokens = {k: 0 for k in learners}
    for i in range(steps + 2):  # the first two rounds warm the caches and are not counted
        for name, learner in learners.items():
            t0, c0 = time.perf_counter(), time.process_time()
            m = learner.step(data[i % batches], publish=False)
            if i >= 2:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                rows[name].append(m["rows"])
                tokens[name] += m["num_tokens"]
    base = "random/1"
    out = {}
    for name in learners:
        out[name] = {"rows_mean": round(float(np.mean(rows[name])), 2),
                     "fill": round(tokens[name] / (float(np.sum(rows[name])) * cfg.learner.pack_length), 3),
                     "wall_ms": _spread(wall[name]), "cpu_ms": _spread(cpu[name]), "warmup": warm[name],
                     "wall_vs_random_pow2": round(float(np.mean(wall[name]) / np.mean(wall[base])), 3),
                     "cpu_vs_random_pow2": round(float(np.mean(cpu[name]) / np.mean(cpu[base])), 3)}
    return {"bench": "learner_packing", "steps": steps, "preset": cfg.model.preset,
            "geometry": f"{rt.prompts_per_step}x{rt.samples_per_prompt}, {cfg.learner.mini_batches} updates, "
                        f"rows of {cfg.learner.pack_length}", "variants": out}


def print_table(result: dict) -> None:
    print(f"learner step, packed ({result['preset']}, {result['geometry']}; {result['steps']} steps each, interleaved)")
    print(f"  {'draw / rows per doubling':26s} {'rows':>6s} {'fill':>6s} {'wall ms mean [p10-p90]':>24s} "
          f"{'cpu ms':>7s} {'wall/base':>9s} {'cpu/base':>8s} {'warm-up':>14s}")
    for name, v in result["variants"].items():
        w = v["wall_ms"]
        print(f"  {name:26s} {v['rows_mean']:6.2f} {v['fill']:6.3f} {w['mean']:>9.1f} [{w['p10']:.0f}-{w['p90']:.0f}]"
              f"{'':5s} {v['cpu_ms']['mean']:7.1f} {v['wall_vs_random_pow2']:9.3f} {v['cpu_vs_random_pow2']:8.3f} "
              f"{v['warmup']['shapes']:3d} shapes {v['warmup']['s']:4.0f}s")


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench learner --packing")
    ap.add_argument("--packing", action="store_true")
    ap.add_argument("--quick", action="store_true", help="20 steps per variant")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 80; 20 with --quick)")
    args = ap.parse_args(argv)
    result = run(args.steps or (20 if args.quick else 80))
    print_table(result)
    return emit(result)
