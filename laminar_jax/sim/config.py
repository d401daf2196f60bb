"""Config section for the cluster simulator (laminar_jax.sim)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import ml_collections

from laminar_jax.configlib import expect, from_config_dict, to_config_dict

SIM_MODES = ("sync", "one_step", "stream", "partial_rollout", "laminar", "inflight")


@dataclasses.dataclass(frozen=True)
class SimSection:
    """One simulated placement and workload.

    Attributes:
      model: Model shape name (laminar_jax.model.PRESETS or qwen2.5-32b / qwen2.5-72b).
      gpu: GPU preset (h100, h200, h800, a100).
      gpus: Total GPUs (learner + rollouts).
      learner_gpus: GPUs of the learner; None = half of `gpus` rounded to whole machines.
      rollout_tp: Tensor-parallel width of one rollout server; None = smallest that fits.
      colocate: sync only: learner and rollouts time-share all GPUs (verl hybrid engine); learner_gpus is ignored.
      mode: 'sync', 'one_step', 'stream', 'partial_rollout' (AReaL-style, sim-only), 'laminar' or 'inflight' (runtime.mode='inflight': each server takes a new version as soon as it arrives, live sequences and all).
      inflight_kv: mode='inflight': live sequences keep their KV at a swap ('keep', no extra work) or re-prefill it under the new weights ('reprefill', charged at prefill speed), as rollout.inflight_kv.
      repack: Run dynamic repack (laminar only).
      workload: Workload preset (math, agentic, uniform).
      prompts_per_step: Prompts (GRPO groups) per learner step (one publish = one version) in every mode, as runtime.prompts_per_step; None = 512 (the global batch of 8192 trajectories).
      samples_per_prompt: Responses per prompt.
      max_staleness: Staleness bound of the AReaL capacity rule for stream and partial_rollout.
      laminar_max_staleness: Staleness bound for laminar (and inflight) dispatch; None = unbounded (the paper's default).
      buffer_max_staleness: select_fifo drops groups staler than this; None = never.
      max_buffered_steps: Capacity: dispatch pauses while complete, unconsumed groups exceed this many steps.
      max_inflight_batches: The runtime's back-pressure (runtime.max_inflight_batches) for unbounded laminar and inflight: at most this many steps of prompts dispatched and not yet trained on; None = off (slots and buffer capacity only).
      max_queued_prompts: The runtime's work-queue bound (prompts dispatched, not yet admitted by a server); None = the runtime's default, max(prompts_per_step, 2 * servers).
      admit_lag: Laminar: a server keeps admitting while at most this many versions behind (scheduler.admit_lag).
      max_mean_staleness: Planner: a plan must keep the mean staleness of consumed groups at or below this.
      max_p99_staleness: Planner: a plan must keep the 99th percentile of staleness at or below this.
      max_num_seqs: Slots (concurrent sequences) per rollout server.
      page_tokens: Tokens per KV page.
      admit_kv_frac: A server admits prompts only while its KV use stays below this fraction.
      repack_interval_s: Seconds between repack plans (also planned at the first tick after a publish).
      c_max: Repack destination KV bound (fraction).
      max_batch: Repack roofline batch bound B.
      tick_s: Simulated seconds per rollout tick (servers advance many decode steps per tick).
      duration_s: Simulated seconds to run at least.
      warmup_s: Throughput and idle figures ignore the first warmup_s seconds.
      min_steps: Keep running past duration_s until this many learner steps ended after warm-up.
      max_duration_s: Hard cap on simulated time.
      seed: Seed of the workload draws.
      timeline_servers: Servers recorded in the timeline picture (0 = none).
      calibration: JSON file of fitted cost parameters (laminar_jax.sim.calibrate), or None.
      shared_host: The learner and every rollout server share one host's CPU (a CPU run): processor
        sharing between the two planes, so while the learner trains and servers decode each plane
        gets half of the host (the decoding servers split generation's half equally) and a plane
        alone gets all of it; a learner step ends when it has had its work's worth of host time.
    """

    model: str = "qwen2.5-7b"
    gpu: str = "h800"
    gpus: int = 64
    learner_gpus: Optional[int] = None
    rollout_tp: Optional[int] = None
    colocate: bool = False
    mode: Literal["sync", "one_step", "stream", "partial_rollout", "laminar", "inflight"] = "laminar"
    inflight_kv: Literal["keep", "reprefill"] = "keep"
    repack: bool = True
    workload: str = "math"
    prompts_per_step: Optional[int] = None
    samples_per_prompt: int = 16
    max_staleness: int = 2
    laminar_max_staleness: Optional[int] = None
    buffer_max_staleness: Optional[int] = None
    max_buffered_steps: float = 2.0
    max_inflight_batches: Optional[int] = 2
    max_queued_prompts: Optional[int] = None
    admit_lag: int = 0
    max_mean_staleness: float = 2.0
    max_p99_staleness: float = 6.0
    max_num_seqs: int = 256
    page_tokens: int = 16
    admit_kv_frac: float = 0.95
    repack_interval_s: float = 5.0
    c_max: float = 0.99
    max_batch: int = 64
    tick_s: float = 1.0
    duration_s: float = 3600.0
    warmup_s: float = 600.0
    min_steps: int = 0
    max_duration_s: float = 6 * 3600.0
    seed: int = 0
    timeline_servers: int = 0
    calibration: Optional[str] = None
    shared_host: bool = False

    def validate(self, prefix: str) -> None:
        expect(self.gpus >= 2, f"{prefix}.gpus", self.gpus, ">= 2")
        if self.learner_gpus is not None:
            expect(1 <= self.learner_gpus < self.gpus, f"{prefix}.learner_gpus", self.learner_gpus,
                   f"in [1, gpus={self.gpus})")
        if self.rollout_tp is not None:
            expect(self.rollout_tp >= 1, f"{prefix}.rollout_tp", self.rollout_tp, ">= 1")
        if self.prompts_per_step is not None:
            expect(self.prompts_per_step >= 1, f"{prefix}.prompts_per_step", self.prompts_per_step, ">= 1")
        expect(not self.colocate or self.mode == "sync", f"{prefix}.colocate", self.colocate,
               f"false unless mode='sync' (mode={self.mode!r})")
        expect(self.inflight_kv in ("keep", "reprefill"), f"{prefix}.inflight_kv", self.inflight_kv,
               "one of ['keep', 'reprefill']")
        expect(self.samples_per_prompt >= 1, f"{prefix}.samples_per_prompt", self.samples_per_prompt, ">= 1")
        expect(self.max_staleness >= 0, f"{prefix}.max_staleness", self.max_staleness, ">= 0")
        expect(self.max_buffered_steps > 0, f"{prefix}.max_buffered_steps", self.max_buffered_steps, "> 0")
        if self.max_inflight_batches is not None:
            expect(self.max_inflight_batches >= 1, f"{prefix}.max_inflight_batches", self.max_inflight_batches,
                   ">= 1 or None")
        if self.max_queued_prompts is not None:
            expect(self.max_queued_prompts >= 1, f"{prefix}.max_queued_prompts", self.max_queued_prompts, ">= 1 or None")
        expect(self.admit_lag >= 0, f"{prefix}.admit_lag", self.admit_lag, ">= 0")
        expect(self.max_mean_staleness >= 0, f"{prefix}.max_mean_staleness", self.max_mean_staleness, ">= 0")
        expect(self.max_p99_staleness >= self.max_mean_staleness, f"{prefix}.max_p99_staleness",
               self.max_p99_staleness, f">= max_mean_staleness={self.max_mean_staleness}")
        expect(self.max_num_seqs >= 1, f"{prefix}.max_num_seqs", self.max_num_seqs, ">= 1")
        expect(self.page_tokens >= 1, f"{prefix}.page_tokens", self.page_tokens, ">= 1")
        expect(0 < self.admit_kv_frac <= 1, f"{prefix}.admit_kv_frac", self.admit_kv_frac, "in (0, 1]")
        expect(0 < self.c_max <= 1, f"{prefix}.c_max", self.c_max, "in (0, 1]")
        expect(self.max_batch >= 1, f"{prefix}.max_batch", self.max_batch, ">= 1")
        expect(self.tick_s > 0, f"{prefix}.tick_s", self.tick_s, "> 0")
        expect(self.repack_interval_s >= self.tick_s, f"{prefix}.repack_interval_s", self.repack_interval_s,
               f">= tick_s={self.tick_s}")
        expect(self.duration_s > self.warmup_s >= 0, f"{prefix}.warmup_s", self.warmup_s,
               f"in [0, duration_s={self.duration_s})")
        expect(self.max_duration_s >= self.duration_s, f"{prefix}.max_duration_s", self.max_duration_s,
               f">= duration_s={self.duration_s}")

    def steps_prompts(self) -> int:
        # One version per learner step of the same global batch in every mode, as the runtime does
        # (its mini-batches are optimizer updates inside a step, not publishes).
        return self.prompts_per_step if self.prompts_per_step is not None else 512


def default_sim_config() -> ml_collections.ConfigDict:
    return to_config_dict(SimSection())


def finalize_sim(cd) -> SimSection:
    """ConfigDict/dict -> validated SimSection (unknown keys and bad values name the field)."""
    sec = from_config_dict(SimSection, cd, "sim")
    sec.validate("sim")
    return sec
