"""Placement planner: search the learner/rollout GPU split (and rollout TP) per mode by simulation.

For each mode and TP width: simulate a coarse grid of learner shares (whole machines, at least the
learner's memory floor), then refine around the best point by bisection toward its better
neighbour. ``sync`` also tries the colocated placement (learner and rollouts time-share all GPUs).
Every point is a short simulation of the same workload and seed, so candidates are compared on
identical prompts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional, Sequence

from laminar_jax.sim.api import cost_model, simulate
from laminar_jax.sim.config import SimSection
from laminar_jax.sim.cost import CostParams
from laminar_jax.sim.metrics import SimResult

ALL_MODES = ("sync", "one_step", "stream", "partial_rollout", "laminar", "laminar_norepack", "laminar_bounded")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A placement to simulate.

    Attributes:
      learner_gpus: Learner GPUs (ignored when colocated).
      tp: GPUs per rollout server.
      colocate: sync only: learner and rollouts share every GPU.
    """

    learner_gpus: int
    tp: int
    colocate: bool = False


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """The best placement found for one mode.

    Attributes:
      mode: Mode name (laminar_norepack = laminar with repack off).
      best: The winning placement.
      result: Its simulation result.
      tried: Every placement simulated, with its throughput.
    """

    mode: str
    best: Candidate
    result: SimResult
    tried: tuple[tuple[Candidate, float], ...]


def mode_config(base: SimSection, mode: str, cand: Candidate) -> SimSection:
    """base with mode and placement applied. Planner-only names: laminar_norepack = laminar with repack
    off; laminar_bounded = laminar whose dispatch obeys the same staleness bound as stream
    (laminar_max_staleness = max_staleness)."""
    repack, lam_bound = base.repack, base.laminar_max_staleness
    if mode == "laminar_norepack":
        mode, repack = "laminar", False
    elif mode == "laminar_bounded":
        mode, lam_bound = "laminar", base.max_staleness
    return dataclasses.replace(base, mode=mode, repack=repack, laminar_max_staleness=lam_bound, rollout_tp=cand.tp,
                               learner_gpus=None if cand.colocate else cand.learner_gpus,
                               colocate=cand.colocate)


def tp_options(base: SimSection, params: Optional[CostParams], search_tp: bool) -> list[int]:
    """The smallest TP that fits, and (when searching) twice that, up to one machine."""
    if base.rollout_tp is not None:
        return [base.rollout_tp]
    cm = cost_model(base, params)
    tps = [cm.tp]
    if search_tp and cm.tp * 2 <= cm.gpu.gpus_per_node:
        tps.append(cm.tp * 2)
    return tps


def learner_grid(gpus: int, floor: int, node: int, tp: int, points: int) -> list[int]:
    """Up to ``points`` learner sizes in whole machines between floor and gpus - one rollout node."""
    lo, hi = floor, gpus - max(node, tp)
    if hi < lo:
        return []
    steps = (hi - lo) // node
    if steps + 1 <= points:
        return list(range(lo, hi + 1, node))
    out = sorted({lo + int(round(i * steps / (points - 1))) * node for i in range(points)})
    return out


def search_mode(base: SimSection, mode: str, params: Optional[CostParams] = None, points: int = 5,
                refine: int = 2, search_tp: bool = True,
                progress: Optional[Callable[[str], None]] = None) -> PlanRow:
    """Best placement of one mode for base's model, GPU type and GPU count."""
    tried: dict[Candidate, SimResult] = {}

    def run(c: Candidate) -> float:
        if c not in tried:
            tried[c] = simulate(mode_config(base, mode, c), params)
            if progress:
                progress(f"{mode:16s} learner={c.learner_gpus:5d} tp={c.tp} colocate={c.colocate}: "
                         f"{tried[c].tokens_per_s:12.0f} tok/s")
        return tried[c].tokens_per_s

    for tp in tp_options(base, params, search_tp):
        cm = cost_model(base, params, tp)
        node = cm.gpu.gpus_per_node
        if mode == "sync":
            run(Candidate(base.gpus, tp, True))
        grid = learner_grid(base.gpus, cm.min_learner_gpus(), node, tp, points)
        scores = [run(Candidate(g, tp)) for g in grid]
        if not grid:
            continue
        for _ in range(refine):  # bisect toward the better neighbour of the best point
            i = max(range(len(grid)), key=lambda j: scores[j])
            nbrs = [j for j in (i - 1, i + 1) if 0 <= j < len(grid)]
            if not nbrs:
                break
            j = max(nbrs, key=lambda j: scores[j])
            mid = (grid[i] + grid[j]) // 2 // node * node
            if mid in grid:
                break
            grid.insert(max(i, j), mid)
            scores.insert(max(i, j), run(Candidate(mid, tp)))
    if not tried:
        raise ValueError(f"plan: no feasible placement of {base.model} on {base.gpus} {base.gpu} GPUs")
    best = max(tried, key=lambda c: tried[c].tokens_per_s)
    return PlanRow(mode, best, tried[best], tuple((c, r.tokens_per_s) for c, r in tried.items()))


def plan(base: SimSection, modes: Sequence[str] = ALL_MODES, params: Optional[CostParams] = None,
         points: int = 5, refine: int = 2, search_tp: bool = True,
         progress: Optional[Callable[[str], None]] = None) -> list[PlanRow]:
    """search_mode for every mode; rows in the order of ``modes``."""
    for m in modes:
        if m not in ALL_MODES:
            raise ValueError(f"plan: mode {m!r} must be one of {list(ALL_MODES)}")
    return [search_mode(base, m, params, points, refine, search_tp, progress) for m in modes]


def format_table(rows: Iterable[PlanRow]) -> str:
    rows = list(rows)
    sync = next((r.result.tokens_per_s for r in rows if r.mode == "sync"), float("nan"))
    lines = [f"{'mode':18s} {'learner':>7s} {'tp':>3s} {'coloc':>5s} {'tok/s':>12s} {'vs sync':>8s} "
             f"{'roll idle':>9s} {'lrn idle':>8s} {'stale':>6s}"]
    for r in rows:
        x = r.result
        lines.append(f"{r.mode:18s} {x.learner_gpus:7d} {x.rollout_tp:3d} {str(r.best.colocate):>5s} "
                     f"{x.tokens_per_s:12.0f} {x.tokens_per_s / sync if sync > 0 else math.nan:8.2f} "
                     f"{x.rollout_idle:9.2f} {x.learner_idle:8.2f} {x.mean_staleness:6.1f}")
    return "\n".join(lines)
