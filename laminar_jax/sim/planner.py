"""Placement planner: the highest-throughput learner/rollout split (and rollout TP) per mode that
keeps staleness within the target (``max_mean_staleness`` and ``max_p99_staleness``).

For each mode and TP width: simulate a coarse grid of learner shares (whole machines, at least the
learner's memory floor), then refine around the best point by bisection toward its better
neighbour. ``sync`` also tries the colocated placement (learner and rollouts time-share all GPUs).
Back-pressured laminar modes also choose ``max_inflight_batches`` per split: the largest (1, 2, ...)
whose run stays within the staleness target (throughput grows with it, and so does staleness).
A candidate over the target scores below every candidate within it; ``laminar_unbounded`` (no
back-pressure) is exempt and labelled as such. Every point is a short simulation of the same
workload and seed, so candidates are compared on identical prompts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional, Sequence

from laminar_jax.sim.api import cost_model, simulate
from laminar_jax.sim.config import SimSection
from laminar_jax.sim.cost import CostParams
from laminar_jax.sim.metrics import SimResult

ALL_MODES = ("sync", "one_step", "stream", "partial_rollout", "laminar", "laminar_norepack", "laminar_bounded",
             "laminar_unbounded", "inflight", "inflight_reprefill")
# Back-pressured: the planner picks max_inflight_batches.
INFLIGHT_MODES = ("laminar", "laminar_norepack", "inflight", "inflight_reprefill")
MAX_INFLIGHT = 8


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A placement to simulate.

    Attributes:
      learner_gpus: Learner GPUs (ignored when colocated).
      tp: GPUs per rollout server.
      colocate: sync only: learner and rollouts share every GPU.
      inflight: Back-pressured laminar: runtime.max_inflight_batches (None = the base config's).
    """

    learner_gpus: int
    tp: int
    colocate: bool = False
    inflight: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """The best placement found for one mode.

    Attributes:
      mode: Mode name (laminar_norepack = laminar with repack off).
      best: The winning placement.
      result: Its simulation result.
      tried: Every placement simulated, with its throughput.
      within_target: Its staleness meets the target (mean and p99); False also when no candidate did.
      bounded: False for laminar_unbounded (no back-pressure, no staleness target).
    """

    mode: str
    best: Candidate
    result: SimResult
    tried: tuple[tuple[Candidate, float], ...]
    within_target: bool = True
    bounded: bool = True

    @property
    def label(self) -> str:
        """'ok', 'over target' (no candidate met it: the least-stale one's figures), or 'unbounded'."""
        return "unbounded" if not self.bounded else ("ok" if self.within_target else "over target")


def within_target(base: SimSection, r: SimResult) -> bool:
    """Mean and p99 staleness at or under base's target (a run that consumed nothing is not)."""
    return (r.mean_staleness == r.mean_staleness and r.mean_staleness <= base.max_mean_staleness
            and r.p99_staleness <= base.max_p99_staleness)


def mode_config(base: SimSection, mode: str, cand: Candidate) -> SimSection:
    """base with mode and placement applied. Planner-only names: laminar_norepack = laminar with repack
    off; laminar_bounded = laminar whose dispatch obeys the same staleness bound as stream
    (laminar_max_staleness = max_staleness); laminar_unbounded = laminar without the runtime's
    back-pressure (max_inflight_batches = None); inflight_reprefill = inflight with inflight_kv='reprefill'."""
    repack, lam_bound, inflight = base.repack, base.laminar_max_staleness, base.max_inflight_batches
    kv = base.inflight_kv
    if mode == "inflight_reprefill":
        mode, kv = "inflight", "reprefill"
    if mode == "laminar_norepack":
        mode, repack = "laminar", False
    elif mode == "laminar_bounded":
        mode, lam_bound = "laminar", base.max_staleness
    elif mode == "laminar_unbounded":
        mode, inflight = "laminar", None
    if cand.inflight is not None:
        inflight = cand.inflight
    return dataclasses.replace(base, mode=mode, inflight_kv=kv, repack=repack, laminar_max_staleness=lam_bound,
                               rollout_tp=cand.tp,
                               learner_gpus=None if cand.colocate else cand.learner_gpus,
                               colocate=cand.colocate, max_inflight_batches=inflight)


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


def score(base: SimSection, r: SimResult, bounded: bool = True) -> float:
    """Throughput within the staleness target; below every such one (least stale first) when over it."""
    if not bounded or within_target(base, r):
        return r.tokens_per_s
    return -(r.mean_staleness if r.mean_staleness == r.mean_staleness else 1e9)


def best_window(base: SimSection, sim: Callable[[Candidate], SimResult], c: Candidate) -> float:
    """Score of the largest back-pressure window within the target for placement c. Staleness and
    throughput both grow with the window (mean staleness is about window - 1), so start at
    target + 1 and walk up while within the target and still gaining, or down until within it."""
    k = max(1, min(MAX_INFLIGHT, int(base.max_mean_staleness) + 1))
    first = sim(dataclasses.replace(c, inflight=k))
    step = 1 if within_target(base, first) else -1
    best, prev = score(base, first), first
    while 1 <= k + step <= MAX_INFLIGHT:
        k += step
        r = sim(dataclasses.replace(c, inflight=k))
        if step > 0 and (not within_target(base, r) or r.tokens_per_s < 1.02 * prev.tokens_per_s):
            return max(best, score(base, r))  # over the target, or a wider window buys nothing
        best, prev = max(best, score(base, r)), r
        if step < 0 and within_target(base, r):
            break
    return best


def refine_grid(grid: list[int], scores: list[float], node: int, refine: int,
                run: Callable[[int], float]) -> None:
    """Bisect toward the better neighbour of the best point, ``refine`` times (grid, scores grow in place)."""
    for _ in range(refine):
        i = max(range(len(grid)), key=lambda j: scores[j])
        nbrs = [j for j in (i - 1, i + 1) if 0 <= j < len(grid)]
        if not nbrs:
            return
        j = max(nbrs, key=lambda j: scores[j])
        mid = (grid[i] + grid[j]) // 2 // node * node
        if mid in grid:
            return
        grid.insert(max(i, j), mid)
        scores.insert(max(i, j), run(mid))


def search_mode(base: SimSection, mode: str, params: Optional[CostParams] = None, points: int = 5,
                refine: int = 2, search_tp: bool = True,
                progress: Optional[Callable[[str], None]] = None) -> PlanRow:
    """Best placement of one mode for base's model, GPU type and GPU count, within the staleness target."""
    tried: dict[Candidate, SimResult] = {}
    bounded = mode != "laminar_unbounded"

    def sim(c: Candidate) -> SimResult:
        if c not in tried:
            tried[c] = r = simulate(mode_config(base, mode, c), params)
            if progress:
                progress(f"{mode:17s} learner={c.learner_gpus:5d} tp={c.tp} colocate={c.colocate!s:5s} "
                         f"inflight={c.inflight}: {r.tokens_per_s:12.0f} tok/s staleness {r.mean_staleness:.2f} "
                         f"(p99 {r.p99_staleness:.0f})")
        return tried[c]

    def run(c: Candidate) -> float:
        return best_window(base, sim, c) if mode in INFLIGHT_MODES else score(base, sim(c), bounded)

    for tp in tp_options(base, params, search_tp):
        cm = cost_model(base, params, tp)
        if mode == "sync":
            run(Candidate(base.gpus, tp, True))
        grid = learner_grid(base.gpus, cm.min_learner_gpus(), cm.gpu.gpus_per_node, tp, points)
        if grid:
            scores = [run(Candidate(g, tp)) for g in grid]
            refine_grid(grid, scores, cm.gpu.gpus_per_node, refine, lambda g: run(Candidate(g, tp)))
    if not tried:
        raise ValueError(f"plan: no feasible placement of {base.model} on {base.gpus} {base.gpu} GPUs")
    best = max(tried, key=lambda c: score(base, tried[c], bounded))
    return PlanRow(mode, best, tried[best], tuple((c, r.tokens_per_s) for c, r in tried.items()),
                   within_target(base, tried[best]), bounded)


def plan(base: SimSection, modes: Sequence[str] = ALL_MODES, params: Optional[CostParams] = None,
         points: int = 5, refine: int = 2, search_tp: bool = True,
         progress: Optional[Callable[[str], None]] = None) -> list[PlanRow]:
    """search_mode for every mode; rows in the order of ``modes``."""
    for m in modes:
        if m not in ALL_MODES:
            raise ValueError(f"plan: mode {m!r} must be one of {list(ALL_MODES)}")
    return [search_mode(base, m, params, points, refine, search_tp, progress) for m in modes]


def format_table(rows: Iterable[PlanRow]) -> str:
    """One line per mode: split, TP, back-pressure, throughput, staleness (mean, p99), idle fractions, label."""
    rows = list(rows)
    sync = next((r.result.tokens_per_s for r in rows if r.mode == "sync"), float("nan"))
    lines = [f"{'mode':18s} {'learner':>7s} {'tp':>3s} {'coloc':>5s} {'inflight':>8s} {'tok/s':>12s} {'vs sync':>8s} "
             f"{'stale':>6s} {'p99':>4s} {'roll idle':>9s} {'lrn idle':>8s}  staleness target"]
    for r in rows:
        x = r.result
        infl = "-" if r.best.inflight is None else str(r.best.inflight)
        lines.append(f"{r.mode:18s} {x.learner_gpus:7d} {x.rollout_tp:3d} {str(r.best.colocate):>5s} {infl:>8s} "
                     f"{x.tokens_per_s:12.0f} {x.tokens_per_s / sync if sync > 0 else math.nan:8.2f} "
                     f"{x.mean_staleness:6.2f} {x.p99_staleness:4.0f} {x.rollout_idle:9.2f} {x.learner_idle:8.2f}  "
                     f"{r.label}")
    return "\n".join(lines)
