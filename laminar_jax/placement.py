"""Roles on devices: which of the process's devices the learner's mesh spans, which each rollout server's.

Topology is configuration. ``placement.colocate=True`` (the default): the learner's mesh spans
``learner_devices`` devices (all by default) and the rollout servers share the same devices, server
i on the i-th group of ``rollout_tp`` devices (round robin), as on one GPU or Colab.
``colocate=False``: the learner takes the first ``learner_devices`` devices; the servers take the
rest, ``rollout_tp`` devices each, and their number is (devices - learner_devices) / rollout_tp.

The layout is pure policy over device counts (:func:`plan_layout`); :func:`realise` applies it to
the process's devices at the start of a run, and :func:`fit_errors` checks that each device's
share (weights / TP + KV pages, learner state / learner devices) fits its memory where the backend
reports a limit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from laminar_jax.configlib import ConfigError, expect


@dataclasses.dataclass(frozen=True)
class PlacementSection:
    """Which devices each role uses (one host, several accelerators).

    Attributes:
      learner_devices: Devices the learner's mesh (mesh.data x mesh.fsdp x mesh.tensor) spans: the process's first N. None = all of them (colocated, as on one GPU).
      rollout_tp: Devices per rollout server (tensor-parallel width of its engine; must divide the model's KV-head count).
      colocate: True: learner and rollout servers share the devices. False: servers take the devices after the learner's, rollout_tp each, and runtime.num_servers is derived from them.
    """

    learner_devices: Optional[int] = None
    rollout_tp: int = 1
    colocate: bool = True

    def validate(self, prefix: str) -> None:
        expect(self.learner_devices is None or self.learner_devices >= 1, f"{prefix}.learner_devices",
               self.learner_devices, ">= 1 or None (all devices)")
        expect(self.rollout_tp >= 1, f"{prefix}.rollout_tp", self.rollout_tp, ">= 1")
        expect(self.colocate or self.learner_devices is not None, f"{prefix}.learner_devices", self.learner_devices,
               "set (an int) when placement.colocate=False: the servers take the devices after the learner's")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Device indices (into the process's device list) of each role."""

    learner: tuple[int, ...]
    servers: tuple[tuple[int, ...], ...]

    def to_json(self) -> dict:
        return {"learner": list(self.learner), "servers": [list(s) for s in self.servers]}

    def overlap(self) -> bool:
        """True when some server shares a device with the learner or another server."""
        seen = list(self.learner) + [d for s in self.servers for d in s]
        return len(seen) != len(set(seen))


def plan_layout(section: PlacementSection, n_devices: int, num_servers: int) -> Layout:
    """The layout for ``n_devices`` devices; ``num_servers`` is used when colocated (disaggregated
    derives it). Raises ConfigError naming the key that does not fit."""
    tp = section.rollout_tp
    learner = n_devices if section.learner_devices is None else section.learner_devices
    expect(learner <= n_devices, "placement.learner_devices", learner,
           f"<= the {n_devices} devices this process sees")
    if section.colocate:
        expect(n_devices % tp == 0, "placement.rollout_tp", tp,
               f"a divisor of the {n_devices} devices this process sees (colocated servers take groups of rollout_tp)")
        groups = n_devices // tp
        servers = tuple(tuple(range((i % groups) * tp, (i % groups + 1) * tp)) for i in range(num_servers))
        return Layout(tuple(range(learner)), servers)
    rest = n_devices - learner
    expect(rest >= tp, "placement.learner_devices", learner,
           f"<= {n_devices - tp}: {n_devices} devices leave none for a rollout server of placement.rollout_tp={tp}")
    expect(rest % tp == 0, "placement.rollout_tp", tp,
           f"a divisor of the {rest} devices left after placement.learner_devices={learner}")
    servers = tuple(tuple(range(learner + i * tp, learner + (i + 1) * tp)) for i in range(rest // tp))
    return Layout(tuple(range(learner)), servers)


def realise(cfg: Any, devices: Sequence[Any]) -> tuple[Any, Layout]:
    """(cfg with runtime.num_servers derived when disaggregated, the layout over ``devices``).

    Also checks the learner's mesh shape against its device count (mesh.* naming the key).
    """
    from laminar_jax.learner.mesh import resolve_mesh_shape

    layout = plan_layout(cfg.placement, len(devices), cfg.runtime.num_servers)
    if not cfg.placement.colocate:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, num_servers=len(layout.servers)))
    try:
        resolve_mesh_shape(cfg.mesh, len(layout.learner))
    except ValueError as e:
        raise ConfigError(f"mesh: does not fit placement.learner_devices={len(layout.learner)}: {e}") from None
    check_heads(cfg.placement.rollout_tp, cfg.model)
    return cfg, layout


def check_heads(tp: int, model_section: Any) -> None:
    """A preset model whose heads the TP width does not divide fails here, naming both (others at engine build)."""
    from laminar_jax.model.presets import PRESETS

    arch = PRESETS.get(getattr(model_section, "preset", None) or "")
    if arch is not None and (arch.num_kv_heads % tp or arch.num_heads % tp):
        raise ConfigError(f"placement.rollout_tp={tp}: does not divide the model's num_kv_heads={arch.num_kv_heads} "
                          f"/ num_heads={arch.num_heads} (rollout KV pages are split on the KV-head axis)")


# ------------------------------------------------------------------------------------------- memory

def bytes_limits(devices: Sequence[Any]) -> dict[int, Optional[int]]:
    """device.memory_stats()['bytes_limit'] per device index, None where the backend does not report it (CPU)."""
    out: dict[int, Optional[int]] = {}
    for i, d in enumerate(devices):
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = {}
        out[i] = stats.get("bytes_limit")
    return out
