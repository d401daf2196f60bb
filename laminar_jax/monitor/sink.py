"""The metrics sink: the console, `metrics.jsonl`, TensorBoard scalars, the timeline and the summary.

It reads nothing of the run but the plain `RunStats` records the Driver hands it. Every step's
scalars go to `<run_dir>/metrics.jsonl` (one JSON object per line: the curves); the summary is
one JSON object of scalars.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Optional

import jax
import numpy as np

from laminar_jax.cpu.threads import cpu_async_dispatch, xla_cpu_pool_threads
from laminar_jax.kernels import describe_train_attention
from laminar_jax.monitor.console import Console
from laminar_jax.monitor.loggers import make_loggers
from laminar_jax.monitor.timeline import Timeline

# Learner metrics that go to TensorBoard under train/ (when the step reports them).
TB_TRAIN = ("reward_mean", "loss", "pg_loss", "staleness_mean", "staleness_max", "token_staleness_mean",
            "token_staleness_max", "mixed_version_frac", "response_tokens", "step_s",
            "entropy", "clipfrac", "dual_clipfrac", "approx_kl_old", "kl", "kl_loss", "lr", "grad_norm", "vf_loss",
            "vf_clipfrac", "rank_token_imbalance", "tool_call_rate", "publish_wait_s", "is_weight_mean",
            "seq_capped_frac", "seq_masked_frac", "zero_signal_drop_rate")


@dataclasses.dataclass
class RunStats:
    """What the monitor needs to know of a run at one moment (plain data).

    Attributes:
      t0: Process start of the run (time.time()); t_rl: start of the RL clock.
      learner_version: Learner steps done.
      servers: The latest ServerStats of every live rollout server.
      buffer: The buffer service's stats() (queue, ledger, lost prompts, generation counters).
      failures: Failure records (servers, relays, learner) so far.
      repack_moves: Live sequences moved between servers.
      redispatched: Prompts re-dispatched by a resume.
      sft_losses: Losses of the supervised warm-start (empty without one).
      publish: The weight plane's latest timings (learner stall, store/relay visibility), if known.
    """

    t0: float
    t_rl: float
    learner_version: int
    servers: list
    buffer: dict
    failures: list
    repack_moves: int
    redispatched: int
    sft_losses: list
    publish: Optional[dict] = None


def episode_turns(traj) -> int:
    """Policy turns of a multi-turn trajectory: the runs of 1 in its policy mask."""
    m = np.asarray(traj.policy_mask, np.int8)
    return int(m[0] == 1) + int(np.sum((m[1:] == 1) & (m[:-1] == 0))) if len(m) else 0


def eval_line(record: dict) -> str:
    """One console line for a finished eval round."""
    o = record["metrics"].get("overall", {})
    figures = " ".join(f"{k} {v:.3f}" for k, v in o.items() if isinstance(v, float))
    return (f"eval round {record['round']} at version {record['step']} (versions {record['versions']}, "
            f"{o.get('prompts', 0)} prompts, {record['duration_s']:.1f}s): {figures}")


def _flat_config(cfg) -> Optional[dict]:
    """The run's config as a plain dict (for W&B's run config)."""
    try:
        from laminar_jax.configlib import to_json

        return json.loads(to_json(cfg))
    except Exception:  # noqa: BLE001 - a config the logger cannot show is no reason to fail the run
        return None


def _tool_call_ids(cfg) -> tuple:
    """Token ids of TOOL_CALL_START with the run's tokenizer (empty without episodes)."""
    env = getattr(cfg, "env", None)
    if env is None or not env.enabled:
        return ()
    from laminar_jax.env.tools import TOOL_CALL_START
    from laminar_jax.model import load_tokenizer

    return tuple(load_tokenizer(cfg.model.tokenizer).encode(TOOL_CALL_START))


def _env_sandbox(cfg) -> dict:
    """Multi-turn runs: how model-written code was isolated ('none' is named so no one misses it) and,
    sandboxed, how its limits hold on this host (env/cgroup.py: a cgroup's totals, or rlimits and why)."""
    env = getattr(cfg, "env", None)
    if env is None or not env.enabled:
        return {}
    if env.sandbox != "bwrap":
        return {"env_sandbox": env.sandbox}
    from laminar_jax.env.cgroup import sandbox_limits

    return {"env_sandbox": env.sandbox, "env_sandbox_limits": sandbox_limits()}


def _shared_frac(servers: list) -> Optional[float]:
    shared = sum(s.prompts_shared for s in servers)
    total = shared + sum(s.prompts_prefilled for s in servers)
    return round(shared / total, 4) if total else None


def _decode_kernels(servers: list) -> Optional[dict]:
    """The servers' decode kernels (rollout/kernels.py, DecodeKernels.summary): the one choice when
    they agree, else {server_id: choice}."""
    kinds = {s.server_id: s.decode_kernel for s in servers if getattr(s, "decode_kernel", None)}
    distinct = {repr(k) for k in kinds.values()}
    return next(iter(kinds.values())) if len(distinct) == 1 else (kinds or None)


def _round(x: Optional[float], nd: int = 4) -> Optional[float]:
    return None if x is None else round(float(x), nd)


class SeenIds:
    """Which ids were seen, at about 8 bytes each however long the run: a 64-bit digest per id, the
    newest in a set and the rest in one sorted array that the set is merged into now and then.
    The run's trajectory uids would otherwise cost ~110 bytes each (a 10k-step run of 512 per step:
    ~500 MB). Two ids share a digest with probability ~n^2 / 2^65 (5e6 ids: ~7e-7)."""

    def __init__(self, merge_at: int = 1 << 16):
        self._sorted = np.empty(0, np.uint64)
        self._recent: set[int] = set()
        self._merge_at = merge_at

    def add(self, key: str) -> bool:
        """Record ``key``; False when it was seen before."""
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        i = int(np.searchsorted(self._sorted, np.uint64(h)))
        if h in self._recent or (i < len(self._sorted) and int(self._sorted[i]) == h):
            return False
        self._recent.add(h)
        if len(self._recent) >= self._merge_at:  # amortised: one O(n) merge per merge_at new ids
            self._sorted = np.union1d(self._sorted, np.fromiter(self._recent, np.uint64, len(self._recent)))
            self._recent.clear()
        return True

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)


class Monitor:
    def __init__(self, cfg, run_dir: str, t0: float):
        self.cfg, self.run_dir, self.t0 = cfg, run_dir, t0
        self.timeline = Timeline(t0)
        self.steps: list[dict] = []
        self.trained_tokens = 0  # sum of the steps' tokens, kept as they come (the console's tok/s each step)
        self.duplicates = 0
        self.trained_uids = SeenIds()
        self.duplicate_trajectories = 0
        self._cpu_first: Optional[tuple[float, float]] = None  # (wall, process CPU) at the first/last step
        self._cpu_last: Optional[tuple[float, float]] = None
        self.cpu_sources: list = []  # CPU seconds of the run's other processes (rollout child processes)
        os.makedirs(run_dir, exist_ok=True)
        # runtime.loggers: TensorBoard (tb/) and/or W&B; None when there are none.
        self._tb = make_loggers(cfg.runtime.loggers, run_dir, cfg.runtime.wandb_project, _flat_config(cfg))
        self.evals: list[dict] = []  # finished eval rounds (eval.jsonl)
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        self.console = Console(cfg.runtime.progress, t0)
        self._sft_logged = False
        self._tool_start = _tool_call_ids(cfg)
        self._signal_seen = 0  # zero-signal groups the buffer service had filtered at the last step

    def phase(self, what: str) -> None:
        self.console.phase(what)

    def on_publish(self, t: float, version: int) -> None:
        self.timeline.publish(t, version)

    def on_step(self, metrics: dict, trajs, stats: RunStats) -> None:
        now = time.time()
        self._cpu_last = (now, time.process_time() + sum(source() for source in self.cpu_sources))
        if self._cpu_first is None:
            self._cpu_first = self._cpu_last
        for t in trajs:
            if not self.trained_uids.add(t.uid):
                self.duplicate_trajectories += 1
        rec = {"t": now - stats.t_rl, "wall": now - stats.t0, **{k: float(v) for k, v in metrics.items()
                                                                   if np.isscalar(v)}}
        rec["tokens"] = int(sum(t.num_tokens for t in trajs))
        turns = [episode_turns(t) for t in trajs if t.policy_mask is not None]
        if turns:
            rec["turns_per_trajectory"] = float(np.mean(turns))
        if self._tool_start:  # share of this step's trajectories that called a tool at least once
            from laminar_jax.env.tools import calls_tool

            calls = [calls_tool(t.response_ids, t.response_policy_mask(), self._tool_start) for t in trajs]
            rec["tool_call_rate"] = float(np.mean(calls)) if calls else 0.0
        rec["versions"] = [s.version for s in stats.servers]
        if self.cfg.learner.dynamic_sampling:
            rec.update(self._zero_signal_step(stats.buffer, trajs))
        self.steps.append(rec)
        self.trained_tokens += rec["tokens"]
        step = int(metrics["version"])
        self._metrics.write(json.dumps({"step": step, **rec}) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            self._tensorboard(rec, step, stats)
        tps = self.trained_tokens / max(rec["t"], 1e-9)
        self.console.step(step, self.cfg.runtime.total_steps, rec, tps, stats.servers, stats.buffer.get("queue", 0),
                          rec["t"] * step / max(len(self.steps), 1))

    def _zero_signal_step(self, buffer: dict, trajs) -> dict:
        """Dynamic sampling since the last step: groups filtered, and their share of the groups that
        left the buffer (filtered + this step's trained groups). The buffer service counts from its
        own start (a replaced or resumed one starts again at 0)."""
        filtered = int(buffer.get("zero_signal_groups_filtered", 0))
        df = filtered - (self._signal_seen if filtered >= self._signal_seen else 0)
        self._signal_seen = filtered
        trained = len({t.prompt_uid for t in trajs})
        return {"zero_signal_dropped": df, "zero_signal_drop_rate": df / max(df + trained, 1)}

    def _tensorboard(self, rec: dict, step: int, stats: RunStats) -> None:
        for k in TB_TRAIN:
            if k in rec:
                self._tb.add_scalar(f"train/{k}", rec[k], step)
        self._tb.add_scalar("rollout/queue", stats.buffer.get("queue", 0), step)
        for k, v in self.env_summary().items():  # multi-turn episodes only
            if v is not None:
                self._tb.add_scalar(f"env/{k}", v, step)
        if stats.buffer.get("latency_p50_s") is not None:
            self._tb.add_scalar("rollout/latency_p50_s", stats.buffer["latency_p50_s"], step)
        for k, v in (stats.publish or {}).items():  # learner stall, store and relay visibility of this version
            self._tb.add_scalar(f"relay/{k}", v, step)
        if stats.sft_losses and not self._sft_logged:
            for i, loss in enumerate(stats.sft_losses):
                self._tb.add_scalar("warm_start/loss", loss, i)
            self._sft_logged = True

    def on_eval(self, record: dict) -> None:
        """A finished eval round: one line of eval.jsonl, scalars eval/<source>/<figure>, a console line."""
        self.evals.append(record)
        with open(os.path.join(self.run_dir, "eval.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for source, figures in record["metrics"].items():
                for k, v in figures.items():
                    if v is not None:  # 'pass@k' -> 'pass_at_k': TensorBoard rewrites '@' in tags
                        self._tb.add_scalar(f"eval/{source}/{k.replace('@', '_at_')}", v, record["step"])
        self.console.phase(eval_line(record))

    def eval_summary(self) -> dict:
        """The last eval round's overall figures as flat scalars (eval_acc, eval_pass@k, ...)."""
        if not self.evals:
            return {}
        last = self.evals[-1]
        return {"eval_rounds": len(self.evals), "eval_step": last["step"],
                **{f"eval_{k}": v for k, v in last["metrics"].get("overall", {}).items()}}

    def cpu_cores_busy(self) -> Optional[float]:
        """CPU seconds this process (and its rollout child processes) spent per second of RL, first
        step to last (how many cores the run kept busy). Local runtime only: under Ray the planes
        run in other processes."""
        if self.cfg.runtime.kind != "local" or self._cpu_first is None or self._cpu_last[0] <= self._cpu_first[0]:
            return None
        return round((self._cpu_last[1] - self._cpu_first[1]) / (self._cpu_last[0] - self._cpu_first[0]), 3)

    def summary(self, stats: RunStats, stopped_early: bool) -> dict:
        rt = self.cfg.runtime
        wall = time.time() - stats.t0
        rl_wall = max(time.time() - stats.t_rl, 1e-9)
        b, ledger = stats.buffer, stats.buffer.get("ledger", {})
        generated = b.get("generated_tokens", 0)
        rewards = [s["reward_mean"] for s in self.steps if "reward_mean" in s]
        k = max(1, min(3, len(rewards) // 4)) if rewards else 1
        timeline_png = None
        if rt.timeline and self.timeline.samples:
            timeline_png = self.timeline.render(os.path.join(self.run_dir, "timeline.png"),
                                                title=f"mode={rt.mode}", t_start=stats.t_rl)
        return {
            "mode": rt.mode,
            "steps": int(stats.learner_version),
            "steps_this_run": len(self.steps),
            "wall_s": round(wall, 2),
            "rl_wall_s": round(rl_wall, 2),
            "train_tokens_per_s": round(self.trained_tokens / rl_wall, 2),
            # Share of RL wall-clock the learner spent in its step (1.0 = learner-bound).
            "learner_busy_frac": round(sum(s.get("step_s", 0.0) for s in self.steps) / rl_wall, 4),
            "reward_first": round(float(np.mean(rewards[:k])), 4) if rewards else None,
            "reward_last": round(float(np.mean(rewards[-k:])), 4) if rewards else None,
            "mean_staleness": round(float(np.mean([s.get("staleness_mean", 0.0) for s in self.steps])), 3)
            if self.steps else None,
            # Per policy token (a trajectory that spans versions, runtime.mode='inflight', counts each token's own).
            "mean_token_staleness": round(float(np.mean([s.get("token_staleness_mean", 0.0) for s in self.steps])), 3)
            if self.steps else None,
            "max_token_staleness": max((int(s.get("token_staleness_max", 0)) for s in self.steps), default=None),
            "mixed_version_frac": round(float(np.mean([s.get("mixed_version_frac", 0.0) for s in self.steps])), 4)
            if self.steps else None,
            # Prompts in flight (dispatched, not consumed) with no trace left to finish them.
            "lost_prompts": int(b.get("lost_prompts", 0)),
            "duplicated_prompts": self.duplicates + self.duplicate_trajectories,
            "redispatched_prompts": stats.redispatched,
            # Rewards that raised, timed out or fell outside float32 (scored 0, never Infinity here).
            "reward_failures": int(b.get("reward_failures", 0)),
            "consumed_prompts": ledger.get("consumed", 0),
            "dropped_prompts": ledger.get("dropped", 0),
            # Dynamic sampling (learner.dynamic_sampling): zero-signal groups filtered (ledger state
            # 'filtered'), their share of all groups that left the buffer, and those trained past the bound.
            "zero_signal_groups_dropped": ledger.get("filtered", 0),
            "zero_signal_drop_rate": round(ledger.get("filtered", 0)
                                           / max(ledger.get("filtered", 0) + ledger.get("consumed", 0), 1), 4),
            "zero_signal_groups_kept": int(b.get("zero_signal_groups_kept", 0)),
            "in_flight_prompts": ledger.get("in_flight", 0),
            "slot_util": round(self.timeline.slot_utilization(), 4),
            "cpu_cores_busy": self.cpu_cores_busy(),
            # This process's XLA CPU pool (runtime.cpu_threads) and dispatch, as they ran.
            "xla_cpu_pool_threads": xla_cpu_pool_threads(),
            "cpu_async_dispatch": cpu_async_dispatch(),
            "kv_util": _round(self.timeline.kv_utilization()),
            # Admissions that copied a live sample's prompt KV instead of prefilling (rollout.share_prompt_kv),
            # over the servers alive at the end.
            "prompts_shared_frac": _shared_frac(stats.servers),
            # The kernels each side runs (the kernel seam), with the reason for any fallback.
            "decode_kernel": _decode_kernels(stats.servers),
            "train_attention": describe_train_attention(self.cfg.learner.attention_impl, jax.default_backend()),
            # Generation side: response tokens finished per second of RL, and each sample's time
            # from dispatch to completion (queueing included).
            "gen_tokens_per_s": round(generated / rl_wall, 2) if generated else None,
            "latency_p50_s": _round(b.get("latency_p50_s")),
            "latency_p99_s": _round(b.get("latency_p99_s")),
            # Weight swaps, per server: drained and ready -> serving the new version (rollout.prefetch
            # stages it while the server drains), and the share staged before the drain ended.
            **self.timeline.swap_figures(),
            "sft_loss": [round(stats.sft_losses[0], 4), round(stats.sft_losses[-1], 4)] if stats.sft_losses else None,
            "reward_curve": [(round(s["t"], 2), round(s["reward_mean"], 4)) for s in self.steps if "reward_mean" in s],
            "staleness_curve": [(round(s["t"], 2), round(s.get("staleness_mean", 0.0), 3)) for s in self.steps],
            **self.env_summary(),
            **_env_sandbox(self.cfg),
            **self.eval_summary(),
            **self.tool_call_curve(),
            "repack_moves": stats.repack_moves,
            "failures": list(stats.failures),
            "stopped_early": stopped_early,
            "timeline_png": timeline_png,
            "run_dir": self.run_dir,
        }

    def tool_call_curve(self) -> dict:
        """Multi-turn runs: per step, (RL seconds, share of the step's trajectories with a tool call)."""
        curve = [(round(s["t"], 2), round(s["tool_call_rate"], 4)) for s in self.steps if "tool_call_rate" in s]
        return {"tool_call_curve": curve} if curve else {}

    def env_summary(self) -> dict:
        """Multi-turn figures (empty without episodes): turns, env latency and failures, waiting share."""
        turns = [s["turns_per_trajectory"] for s in self.steps if "turns_per_trajectory" in s]
        env = list(self.timeline.env.values())
        if not turns and not env:
            return {}
        done = sum(e.episodes_done for e in env)
        return {"turns_per_trajectory": _round(float(np.mean(turns)) if turns else None),
                "tool_call_rate": _round(sum(e.tool_call_rate * e.turns_per_episode * e.episodes_done for e in env)
                                         / max(sum(e.turns_per_episode * e.episodes_done for e in env), 1e-9)),
                "env_failures": int(sum(e.env_failures for e in env)), "env_episodes": int(done),
                "env_latency_p50_s": _round(max((e.env_latency_p50_s for e in env), default=None)),
                "env_latency_p99_s": _round(max((e.env_latency_p99_s for e in env), default=None)),
                "env_wait_share": _round(self.timeline.env_wait_share())}

    def close(self) -> None:
        self.console.close()
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
