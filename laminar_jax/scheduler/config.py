"""Config section for the host-side scheduler (repack, heartbeats)."""

from __future__ import annotations

import dataclasses

from laminar_jax.configlib import expect


@dataclasses.dataclass(frozen=True)
class SchedulerSection:
    """Repack and failure detection.

    Attributes:
      repack: Run dynamic repack (laminar mode only).
      repack_interval_s: Seconds between repack plans (also planned right after each publish).
      c_max: Destination KV fill bound for repack, as a fraction of its pages.
      admit_lag: Laminar mode: a server keeps admitting new prompts while its weights are at most this many versions behind the newest; then it drains (helped by repack) and swaps. 0 = stop admitting as soon as a newer version exists. Raises staleness by up to this much.
      max_batch: B, the roofline batch bound used by repack (sources have fewer live sequences; destinations never exceed it).
      heartbeat_timeout_s: A rollout server silent this long is declared dead (its work is requeued and it is replaced).
      max_server_restarts: Rollout server failures tolerated per run before the run stops.
    """

    repack: bool = True
    repack_interval_s: float = 2.0
    c_max: float = 0.99
    max_batch: int = 64
    admit_lag: int = 0
    heartbeat_timeout_s: float = 30.0
    max_server_restarts: int = 8

    def validate(self, prefix: str) -> None:
        expect(0 < self.c_max <= 1, f"{prefix}.c_max", self.c_max, "in (0, 1]")
        expect(self.admit_lag >= 0, f"{prefix}.admit_lag", self.admit_lag, ">= 0")
        expect(self.max_batch >= 1, f"{prefix}.max_batch", self.max_batch, ">= 1")
        expect(self.repack_interval_s > 0, f"{prefix}.repack_interval_s", self.repack_interval_s, "> 0")
        expect(self.max_server_restarts >= 0, f"{prefix}.max_server_restarts", self.max_server_restarts, ">= 0")
        expect(self.heartbeat_timeout_s > 0, f"{prefix}.heartbeat_timeout_s", self.heartbeat_timeout_s, "> 0")
