"""Per-device memory of a run's placement against a named accelerator (``launch/plan.py memory``).

Learner device: its share of the training state (params + grads + AdamW's two moments in
model.param_dtype: 16 bytes per parameter in float32, 8 in bfloat16, sharded over the learner's
devices by FSDP) plus the activations autodiff keeps for one micro-batch's rows on that device
(the learner memory plan's residuals on abstract shapes, reflecting learner.remat and
attention_impl; worst case: every trajectory at rollout.max_total_len, one per packed row).
Rollout device: its weight shard (model.param_dtype / rollout_tp) plus its KV-head share of the
page pool (rollout.num_pages pages of page_size tokens, in model.dtype). Colocated roles add up on
a shared device. Not counted: XLA's scratch buffers and the allocator's fragmentation, hence the
margin the verdict keeps free (10% by default).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from laminar_jax.placement import Layout, plan_layout

GB = 1e9
# Usable memory of one device, in bytes (the vendor's figure).
ACCELERATORS = {"h100": 80 * GB, "h200": 141 * GB, "tpu-v5e": 16 * GB}
TRAIN_STATE_COPIES = 4  # params + grads + AdamW mu and nu, each in model.param_dtype


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    learner_state: int = 0
    learner_activations: int = 0
    rollout_weights: int = 0
    rollout_kv: int = 0

    @property
    def total(self) -> int:
        return self.learner_state + self.learner_activations + self.rollout_weights + self.rollout_kv


def arch_of(cfg: Any):
    """The model's architecture: model.preset (the planner knows presets and the simulator's 32B/72B shapes)."""
    from laminar_jax.configlib import ConfigError
    from laminar_jax.model.presets import PRESETS

    if cfg.model.preset in PRESETS:
        return PRESETS[cfg.model.preset]
    raise ConfigError(f"model.preset={cfg.model.preset!r}: the memory planner needs one of {sorted(PRESETS)}")


def _itemsize(name: str) -> int:
    return 4 if name == "float32" else 2


def kv_bytes(arch, rollout, dtype: str) -> int:
    """The whole page pool of one server: K and V of every layer."""
    return 2 * arch.num_layers * rollout.num_pages * rollout.page_size * arch.num_kv_heads * arch.head_dim * \
        _itemsize(dtype)


def learner_rows_per_device(cfg, learner_devices: int) -> int:
    """Packed rows of one micro-batch on one learner device (at least 1)."""
    rt, ln = cfg.runtime, cfg.learner
    trajectories = rt.prompts_per_step * rt.samples_per_prompt
    per_micro = trajectories / max(1, ln.mini_batches * ln.micro_batches)
    return max(1, math.ceil(per_micro / learner_devices))


def activation_bytes(cfg, arch, rows: int) -> int:
    """Residuals one gradient pass keeps over [rows, pack_length] (abstract shapes; see benchmarks.learner)."""
    import jax.numpy as jnp

    from laminar_jax.benchmarks.learner import memory_plan_residuals

    seq = cfg.learner.pack_length or cfg.rollout.max_total_len
    dtype = jnp.dtype(cfg.model.dtype)
    # The residuals also hold the weights (and their compute-dtype casts), which do not grow with the
    # rows and are counted as learner state: the activations are the part that does.
    one, two = (memory_plan_residuals(arch, cfg.learner, r, seq, dtype) for r in (1, 2))
    return rows * (two - one)


def device_bytes(cfg, layout: Layout, arch, activations: int) -> dict[int, DeviceBytes]:
    """Bytes per device index of the layout."""
    n_params = arch.num_params()
    tp = cfg.placement.rollout_tp
    state = TRAIN_STATE_COPIES * _itemsize(cfg.model.param_dtype) * n_params // len(layout.learner)
    weights = n_params * _itemsize(cfg.model.param_dtype) // tp
    kv = kv_bytes(arch, cfg.rollout, cfg.model.dtype) // tp
    out: dict[int, DeviceBytes] = {}
    for d in layout.learner:
        out[d] = DeviceBytes(learner_state=state, learner_activations=activations)
    for s in layout.servers:
        for d in s:
            had = out.get(d, DeviceBytes())
            out[d] = dataclasses.replace(had, rollout_weights=had.rollout_weights + weights,
                                         rollout_kv=had.rollout_kv + kv)
    return out


def host_layout(cfg, devices: int) -> Layout:
    """The layout on a host of ``devices`` accelerators: the local runtime's placement; under Ray
    (runtime.kind='ray'), the learner's devices (placement.learner_devices, else the whole host)
    and one rollout actor's own rollout_tp devices beside them (every actor is alike)."""
    if cfg.runtime.kind != "ray":
        return plan_layout(cfg.placement, devices, cfg.runtime.num_servers)
    n = cfg.placement.learner_devices or devices
    return Layout(tuple(range(n)), (tuple(range(n, n + cfg.placement.rollout_tp)),))


def report(cfg, accelerator: str, devices: int = 8, activations: Optional[int] = None, margin: float = 0.1) -> dict:
    """Per-device bytes of ``cfg`` on a host of ``devices`` x ``accelerator`` and the verdict."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator {accelerator!r}: one of {sorted(ACCELERATORS)}")
    limit = ACCELERATORS[accelerator]
    arch = arch_of(cfg)
    layout = host_layout(cfg, devices)
    if activations is None:
        activations = activation_bytes(cfg, arch, learner_rows_per_device(cfg, len(layout.learner)))
    per = device_bytes(cfg, layout, arch, activations)
    worst = max(per, key=lambda d: per[d].total)
    rows = [{"device": d, **{k: v / GB for k, v in dataclasses.asdict(b).items()}, "total_gb": b.total / GB}
            for d, b in sorted(per.items())]
    return {"accelerator": accelerator, "device_gb": limit / GB, "devices": devices, "layout": layout.to_json(),
            "params": arch.num_params(), "rows": rows, "worst_device": worst, "worst_gb": per[worst].total / GB,
            "fits": per[worst].total <= (1 - margin) * limit, "margin": margin}


def format_report(r: dict) -> str:
    head = (f"{r['devices']} x {r['accelerator']} ({r['device_gb']:.0f} GB each), {r['params'] / 1e9:.2f}B params, "
            f"layout {r['layout']}")
    lines = [head, f"{'device':>6} {'learner state':>14} {'activations':>12} {'rollout weights':>16} "
                   f"{'KV pages':>9} {'total GB':>9}"]
    for row in r["rows"]:
        lines.append(f"{row['device']:>6} {row['learner_state']:>14.1f} {row['learner_activations']:>12.1f} "
                     f"{row['rollout_weights']:>16.1f} {row['rollout_kv']:>9.1f} {row['total_gb']:>9.1f}")
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: device {r['worst_device']} needs {r['worst_gb']:.1f} GB of {r['device_gb']:.0f} GB "
                 f"(verdict keeps {r['margin']:.0%} free for XLA scratch and fragmentation)")
    return "\n".join(lines)


def fits_summary(cfg, devices: int = 8) -> dict[str, bool]:
    """Verdict per accelerator (one activation estimate shared)."""
    arch = arch_of(cfg)
    layout = host_layout(cfg, devices)
    act = activation_bytes(cfg, arch, learner_rows_per_device(cfg, len(layout.learner)))
    return {a: report(cfg, a, devices, activations=act)["fits"] for a in ACCELERATORS}


__all__ = ["ACCELERATORS", "DeviceBytes", "report", "format_report", "fits_summary", "device_bytes", "kv_bytes"]
