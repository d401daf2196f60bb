"""Progress display, TensorBoard scalars, the end-of-run timeline and the summary line."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import numpy as np


def _round(x: Optional[float], nd: int = 4) -> Optional[float]:
    return None if x is None else round(float(x), nd)


class Monitor:
    def __init__(self, cfg, run_dir: str, run: Any):
        self.cfg, self.run_dir, self.run = cfg, run_dir, run
        self.steps: list[dict] = []
        self.duplicates = 0
        self._traj_lock = threading.Lock()
        self.generated_tokens = 0
        self.latencies: list[float] = []
        self.trained_uids: set[str] = set()
        self.duplicate_trajectories = 0
        self._cpu_first: Optional[tuple[float, float]] = None  # (wall, process CPU) at the first/last step
        self._cpu_last: Optional[tuple[float, float]] = None
        self._tb = None
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
        except ImportError:  # TensorBoard output is optional; the summary JSON always exists
            self._tb = None
        self._console = None
        self._live = None
        if cfg.runtime.progress:
            from rich.console import Console

            self._console = Console()

    def on_trajectory(self, response_tokens: int, latency_s: Optional[float]) -> None:
        """A server finished a trajectory (generation-side counters; any thread)."""
        with self._traj_lock:
            self.generated_tokens += response_tokens
            if latency_s is not None:
                self.latencies.append(latency_s)

    def on_step(self, metrics: dict, trajs) -> None:
        now = time.time()
        self._cpu_last = (now, time.process_time())
        if self._cpu_first is None:
            self._cpu_first = self._cpu_last
        for t in trajs:
            if t.uid in self.trained_uids:
                self.duplicate_trajectories += 1
            self.trained_uids.add(t.uid)
        rec = {"t": now - self.run.t_rl, "wall": now - self.run.t0, **{k: float(v) for k, v in metrics.items()
                                                                     if np.isscalar(v)}}
        rec["tokens"] = int(sum(t.num_tokens for t in trajs))
        rec["versions"] = [w.server.version for w in self.run.workers]
        self.steps.append(rec)
        step = int(metrics["version"])
        if self._tb is not None:
            for k in ("reward_mean", "loss", "staleness_mean", "staleness_max", "response_tokens", "step_s",
                      "entropy", "clip_frac", "kl", "grad_norm"):
                if k in rec:
                    self._tb.add_scalar(f"train/{k}", rec[k], step)
            self._tb.add_scalar("rollout/queue", len(self.run.queue), step)
        if self._console is not None:
            self._print(rec, step)

    def _print(self, rec: dict, step: int) -> None:
        stats = [w.server.stats() for w in self.run.workers]
        slots = " ".join(f"{s.slots_used}/{s.slots_total}" for s in stats)
        tps = sum(r["tokens"] for r in self.steps) / max(rec["t"], 1e-9)
        self._console.print(
            f"[bold]step {step:4d}[/] reward {rec.get('reward_mean', float('nan')):.3f}  "
            f"tok/s {tps:8.1f}  staleness {rec.get('staleness_mean', 0):.2f}  "
            f"versions {rec['versions']}  slots {slots}  queue {len(self.run.queue)}", highlight=False)

    def lost_prompts(self) -> int:
        """Prompts in flight (dispatched, not consumed) with no trace left to finish them."""
        groups = self.run.store.groups()
        return sum(1 for uid, _ in self.run.ledger.in_flight() if uid not in groups)

    def cpu_cores_busy(self) -> Optional[float]:
        """CPU seconds this process spent per second of RL, first step to last (how many cores the
        run kept busy). Local runtime only: under Ray the planes run in other processes."""
        if self.cfg.runtime.kind != "local" or self._cpu_first is None or self._cpu_last[0] <= self._cpu_first[0]:
            return None
        return round((self._cpu_last[1] - self._cpu_first[1]) / (self._cpu_last[0] - self._cpu_first[0]), 3)

    def summary(self, stopped_early: bool) -> dict:
        rt = self.cfg.runtime
        wall = time.time() - self.run.t0
        rl_wall = max(time.time() - self.run.t_rl, 1e-9)
        rewards = [s["reward_mean"] for s in self.steps if "reward_mean" in s]
        k = max(1, min(3, len(rewards) // 4)) if rewards else 1
        timeline_png = None
        if rt.timeline and self.run.timeline.samples:
            timeline_png = self.run.timeline.render(os.path.join(self.run_dir, "timeline.png"),
                                                    title=f"mode={rt.mode}")
        return {
            "mode": rt.mode,
            "steps": int(self.run.learner.version),
            "steps_this_run": len(self.steps),
            "wall_s": round(wall, 2),
            "rl_wall_s": round(rl_wall, 2),
            "train_tokens_per_s": round(sum(s["tokens"] for s in self.steps) / rl_wall, 2),
            # Share of RL wall-clock the learner spent in its step (1.0 = learner-bound).
            "learner_busy_frac": round(sum(s.get("step_s", 0.0) for s in self.steps) / rl_wall, 4),
            "reward_first": round(float(np.mean(rewards[:k])), 4) if rewards else None,
            "reward_last": round(float(np.mean(rewards[-k:])), 4) if rewards else None,
            "mean_staleness": round(float(np.mean([s.get("staleness_mean", 0.0) for s in self.steps])), 3)
            if self.steps else None,
            "lost_prompts": self.lost_prompts(),
            "duplicated_prompts": self.duplicates + self.duplicate_trajectories,
            "redispatched_prompts": self.run.redispatched,
            "consumed_prompts": self.run.ledger.summary()["consumed"],
            "dropped_prompts": self.run.ledger.summary()["dropped"],
            "in_flight_prompts": self.run.ledger.summary()["in_flight"],
            "slot_util": round(self.run.timeline.slot_utilization(), 4),
            "cpu_cores_busy": self.cpu_cores_busy(),
            "kv_util": _round(self.run.timeline.kv_utilization()),
            # Generation side: response tokens finished per second of RL, and each sample's time
            # from dispatch to completion (queueing included).
            "gen_tokens_per_s": round(self.generated_tokens / rl_wall, 2) if self.generated_tokens else None,
            "latency_p50_s": _round(np.percentile(self.latencies, 50) if self.latencies else None),
            "latency_p99_s": _round(np.percentile(self.latencies, 99) if self.latencies else None),
            "sft_loss": [round(self.run.sft_losses[0], 4), round(self.run.sft_losses[-1], 4)]
            if self.run.sft_losses else None,
            "reward_curve": [(round(s["t"], 2), round(s["reward_mean"], 4)) for s in self.steps if "reward_mean" in s],
            "staleness_curve": [(round(s["t"], 2), round(s.get("staleness_mean", 0.0), 3)) for s in self.steps],
            "repack_moves": getattr(self.run.repacker, "moved", 0) if self.run.repacker else 0,
            "failures": list(self.run.failures),
            "stopped_early": stopped_early,
            "timeline_png": timeline_png,
            "run_dir": self.run_dir,
        }

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
