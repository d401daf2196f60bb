"""What a simulation measures, and the result record it returns.

All rates and fractions cover the window [warmup_s, end]; throughput is the steady-state rate
between the first and last learner step ending in the window (tokens of steps 2..n over the time
between step 1's and step n's end), so a run that sees only part of a long iteration is not
credited or charged for the part.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated run.

    Attributes:
      mode: Mode simulated.
      model: Model shape.
      gpus: Total GPUs.
      learner_gpus: Learner GPUs.
      rollout_tp: GPUs per rollout server.
      servers: Rollout servers.
      sim_s: Simulated seconds.
      tokens_per_s: Trajectory tokens (prompt + response) consumed by the learner per second.
      steps: Learner steps ending in the window.
      step_s: Mean seconds between learner step ends in the window.
      learner_idle: Fraction of the window the learner was not training or copying weights out.
      rollout_idle: Fraction of rollout server-time spent neither decoding nor prefilling.
      gpu_idle: Fraction of all GPU-time doing neither training nor generation (colocated GPUs count once).
      kv_util: Time-mean fraction of KV pages in use over servers.
      slot_util: Time-mean fraction of slots holding a live sequence.
      mean_staleness: Mean staleness of consumed groups.
      p99_staleness: 99th percentile of the staleness of consumed groups.
      max_staleness: Largest staleness of a consumed group.
      staleness_hist: Consumed groups per staleness value.
      pull_latency_mean_s: Mean time from a server deciding to swap to its new weights being loaded.
      pull_latency_p99_s: 99th percentile of the same.
      repacks: Repack plans made.
      moves: Sequences moved by repack.
      preemptions: Sequences preempted for KV (re-prefilled later).
      reprefill_tokens: Tokens re-prefilled (preemption, partial-rollout interrupts).
      dropped_groups: Groups dropped by the buffer's staleness bound.
      trajectories: Trajectories completed (whole run).
      extra: Free-form details.
    """

    mode: str
    model: str
    gpus: int
    learner_gpus: int
    rollout_tp: int
    servers: int
    sim_s: float
    tokens_per_s: float
    steps: int
    step_s: float
    learner_idle: float
    rollout_idle: float
    gpu_idle: float
    kv_util: float
    slot_util: float
    mean_staleness: float
    p99_staleness: float
    max_staleness: float
    staleness_hist: dict
    pull_latency_mean_s: float
    pull_latency_p99_s: float
    repacks: int
    moves: int
    preemptions: int
    reprefill_tokens: float
    dropped_groups: int
    trajectories: int
    extra: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mode_name(cfg) -> str:
    if cfg.mode == "inflight":
        return "inflight" if cfg.inflight_kv == "keep" else "inflight_reprefill"
    if cfg.mode == "laminar" and not cfg.repack:
        return "laminar_norepack"
    if cfg.mode == "laminar" and cfg.laminar_max_staleness is not None:
        return "laminar_bounded"
    if cfg.mode == "laminar" and cfg.max_inflight_batches is None:
        return "laminar_unbounded"
    return cfg.mode


class Recorder:
    """Accumulates measurements during a run (owned by one Simulator)."""

    def __init__(self, cfg, place, kv_cap: int):
        self.cfg, self.place, self.kv_cap = cfg, place, kv_cap
        self.warm = cfg.warmup_s
        self.ticks = 0
        self.busy = 0.0  # rollout server-seconds decoding or prefilling in the window
        self.kv_acc = self.slot_acc = self.win_s = 0.0
        self.steps_log: list[tuple[float, float, int]] = []  # start, end (incl. d2h), tokens
        self.stale: list[int] = []
        self.pull_lat: list[float] = []
        self.repacks = self.moves = self.preemptions = self.dropped = self.trajectories = 0
        self.moved_pages = self.reprefill_tokens = self.tokens_generated = 0.0
        self.tok_stale_sum = self.tok_count = 0.0  # staleness per generated token (see token_staleness)
        self.learner_host_s = 0.0  # shared_host: learner work (host-seconds) of steps started in the window
        self.timeline = None
        if cfg.timeline_servers > 0:
            from laminar_jax.monitor.timeline import Timeline

            self.timeline = Timeline(0.0)
        self._tl_every = max(1, int(round(10.0 / cfg.tick_s)))

    def add_decode(self, secs: np.ndarray, t: float) -> None:
        if t >= self.warm:
            self.busy += float(secs.sum())

    def add_prefill(self, secs: np.ndarray, t: float) -> None:
        if t >= self.warm:
            self.busy += float(secs.sum())

    def learner_work(self, start: float, host_s: float) -> None:
        if start >= self.warm:
            self.learner_host_s += host_s

    def pulls(self, lat: np.ndarray) -> None:
        self.pull_lat.extend(lat.tolist())

    def publish(self, t: float, version: int) -> None:
        if self.timeline is not None:
            self.timeline.publish(t, version)

    def token_staleness(self, start: float, stale_sum: float, tokens: float) -> None:
        """A consumed batch's staleness per generated token, summed over its tokens (each judged on the
        version that sampled it: in mode='inflight' a trajectory's tokens span versions)."""
        if start >= self.warm:
            self.tok_stale_sum += stale_sum
            self.tok_count += tokens

    def step(self, start: float, end: float, tokens: int, stale: list[int]) -> None:
        self.steps_log.append((start, end, tokens))
        if end >= self.warm:
            self.stale.extend(stale)

    def steps_after_warmup(self) -> int:
        return sum(1 for _, e, _ in self.steps_log if e >= self.warm)

    def sample_tick(self, t: float, t1: float, sim) -> None:
        self.ticks += 1
        if t >= self.warm:
            dt = t1 - t
            self.win_s += dt
            self.kv_acc += dt * float(sim.used.mean()) / max(1, self.kv_cap)
            self.slot_acc += dt * float((sim.sid >= 0).mean())
        if self.timeline is not None and self.ticks % self._tl_every == 0:
            live = (sim.sid >= 0).sum(1)
            for s in range(min(self.cfg.timeline_servers, sim.S)):
                self.timeline.sample(t, f"r{s:03d}", int(live[s]), sim.M, int(sim.version[s]))

    def result(self, t_end: float, sim) -> SimResult:
        cfg, place = self.cfg, self.place
        win = max(t_end - self.warm, 1e-9)
        ends = [(e, tok) for _, e, tok in self.steps_log if self.warm <= e <= t_end]
        if len(ends) >= 2:
            rate = sum(tok for _, tok in ends[1:]) / max(ends[-1][0] - ends[0][0], 1e-9)
            step_s = (ends[-1][0] - ends[0][0]) / (len(ends) - 1)
        else:
            rate = sum(tok for _, tok in ends) / win
            step_s = float("nan")
        l_busy = sum(max(0.0, min(e, t_end) - max(s, self.warm)) for s, e, _ in self.steps_log)
        hist: dict[int, int] = {}
        for x in self.stale:
            hist[x] = hist.get(x, 0) + 1
        r_busy = self.busy / max(sim.S * self.win_s, 1e-9)
        if cfg.colocate:
            gpu_idle = 1.0 - r_busy - l_busy / win
        else:
            gpu_idle = 1.0 - (place.learner_gpus * l_busy / win + place.tp * place.servers * r_busy) / cfg.gpus
        lat = np.asarray(self.pull_lat) if self.pull_lat else np.zeros(1)
        return SimResult(
            mode=_mode_name(cfg),
            model=cfg.model, gpus=cfg.gpus, learner_gpus=place.learner_gpus, rollout_tp=place.tp,
            servers=place.servers, sim_s=t_end, tokens_per_s=rate, steps=len(ends), step_s=step_s,
            learner_idle=1.0 - l_busy / win,
            rollout_idle=1.0 - r_busy, gpu_idle=gpu_idle,
            kv_util=self.kv_acc / max(self.win_s, 1e-9), slot_util=self.slot_acc / max(self.win_s, 1e-9),
            mean_staleness=float(np.mean(self.stale)) if self.stale else float("nan"),
            p99_staleness=float(np.percentile(self.stale, 99)) if self.stale else float("nan"),
            max_staleness=float(max(self.stale)) if self.stale else float("nan"),
            staleness_hist={str(k): v for k, v in sorted(hist.items())},
            pull_latency_mean_s=float(lat.mean()), pull_latency_p99_s=float(np.percentile(lat, 99)),
            repacks=self.repacks, moves=self.moves, preemptions=self.preemptions,
            reprefill_tokens=self.reprefill_tokens, dropped_groups=self.dropped,
            trajectories=self.trajectories,
            extra={"tokens_generated": self.tokens_generated, "moved_pages": self.moved_pages,
                   "kv_pages_per_server": self.kv_cap,
                   # shared_host: fraction of the window the host had work (decode + prefill + learner
                   # host-seconds over window seconds): how busy the model keeps the CPU.
                   "host_busy": (self.busy + self.learner_host_s) / win if cfg.shared_host else None,
                   # Token-weighted, each token judged on its own version (mean_staleness: per group, on its oldest).
                   "mean_token_staleness": self.tok_stale_sum / self.tok_count if self.tok_count else float("nan")})

    def render_timeline(self, path: str, title: str = "") -> Optional[str]:
        if self.timeline is None:
            return None
        return self.timeline.render(path, title)
