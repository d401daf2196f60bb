"""What each device of a run holds, item by item, against its budget (``launch/plan.py memory``, and
the start-time check of a run).

Learner device (its shard of each parameter on the learner mesh, by ``mesh.rules``, as the learner
places it): the master parameters, AdamW's two moments and the gradients in ``model.param_dtype``
(a second gradient copy while micro-batches accumulate), a frozen reference copy under a KL term;
inside the step: the parameters' cast to ``model.dtype`` where it differs plus, where the FSDP axis
is > 1, two layers gathered whole (the one computing and the next; every layer without remat) and
the vocab tables (the embedding, which the token lookup reads gathered so the activations stay
split by rows, and an untied LM head), one layer's whole gradient before its reduce-scatter
(``gathered_grads``; the embedding's lookup gradient is reduce-scattered straight to its shards),
the activations of the device's worst-case micro-batch rows (every trajectory at
``rollout.max_total_len``, one per packed row; ``learner.memory``): every layer's residuals under
``learner.remat``, stacked by the layers' scan, and one layer's activations whole (the layer the
backward pass recomputes, or differentiates without remat), the log-prob chunks' phase
(``logprob_chunks``: one chunk's float32 logits, three arrays of them: logits, softmax, gradient;
or, where larger, under FSDP, the LM head's gradient whole as each chunk's backward makes it: its
float32 product and that product's all-reduce in the compute dtype) and the collated batch twice
(as placed and as prepared). A publish snapshot sits in pinned host memory where the device has it
(GPU, TPU), else on the device.

Rollout device (its TP shard, by the engine's TP rules): one version in the serving dtype
(``rollout.dtype``, else ``model.dtype``), its KV-head share of the page pool, the swap's staging
buffer (the largest single tensor: a swap streams the new version in one tensor at a time; a whole
version with ``rollout.prefetch_device``, which stages the next one on the devices) and the
decode program's temporaries (float32 logits of every slot, three arrays; one layer's gathered live
pages under the live-page attention).

Host: the pinned publish snapshot (one version in the serving dtype) and each relay's
``relay.keep_in_memory`` versions.

Budget: a GPU's memory times ``runtime.gpu_memory_fraction``, the pool the runtime gives XLA's
allocator (gpu_allocator.py); the rest is the allocator's reserve for the CUDA context and
libraries. A TPU's whole HBM. A device FITS when the plan leaves ``margin`` (10%) of its budget free
for fragmentation and what the plan does not model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Optional, Sequence

from laminar_jax.placement import Layout, plan_layout

GB = 1e9
# Memory of one device, in bytes (the vendor's figure), and its kind.
ACCELERATORS = {"h100": (80 * GB, "gpu"), "h200": (141 * GB, "gpu"), "tpu-v5e": (16 * GB, "tpu"),
                "tpu-v5p": (95 * GB, "tpu")}
MARGIN = 0.1
# The shipped accelerator configs: (configs/<name>.py, variant, the accelerator it is sized for, devices of one host).
SHIPPED = (("gpu_single", "", "h100", 1), ("gpu_node", "", "h100", 8), ("gpu_pod", "", "h100", 8),
           ("gpu_node", "32b", "h200", 8), ("tpu_pod", "", "tpu-v5e", 8))
# Which config key shrinks an item (a plan that does not fit names the largest item's).
ITEM_KEYS = {
    "master_params": "placement.learner_devices (more devices for the learner's mesh.fsdp)",
    "adam_moments": "placement.learner_devices (more devices for the learner's mesh.fsdp)",
    "gradients": "placement.learner_devices (more devices for the learner's mesh.fsdp)",
    "ref_params": "learner.kl_coef (a reference copy is kept only for a KL term)",
    "frozen_base": "placement.learner_devices (more devices for the learner's mesh.fsdp) or rollout.dtype",
    "compute_copy": "mesh.tensor (gathered layers are split over the tensor axis)",
    "gathered_grads": "mesh.tensor (gathered layers are split over the tensor axis)",
    "activations": "learner.micro_batches (fewer rows per pass) or learner.remat",
    "logprob_chunks": "learner.logits_chunk_tokens",
    "batch": "runtime.prompts_per_step",
    "publish_snapshot": "learner.publish_snapshot",
    "serving_weights": "placement.rollout_tp (or rollout.dtype)",
    "kv_pool": "rollout.num_pages",
    "swap_staging": "placement.rollout_tp",
    "decode_temporaries": "rollout.num_slots",
}
LEARNER_ITEMS = ("master_params", "adam_moments", "gradients", "ref_params", "frozen_base", "compute_copy",
                 "gathered_grads",
                 "activations", "logprob_chunks", "batch", "publish_snapshot")
ROLLOUT_ITEMS = ("serving_weights", "kv_pool", "swap_staging", "decode_temporaries")
BATCH_FIELDS_2D = 14  # TrainBatch fields of shape [rows, seq] (4 bytes each)


def itemsize(name: str) -> int:
    return 4 if name == "float32" else 2


def serving_dtype(cfg) -> str:
    """The dtype rollout servers hold a version in: rollout.dtype where the config has it, else model.dtype."""
    return getattr(cfg.rollout, "dtype", None) or cfg.model.dtype


def arch_of(cfg: Any):
    """The model's architecture: model.preset (the planner knows presets and the simulator's 32B/72B shapes)."""
    from laminar_jax.configlib import ConfigError
    from laminar_jax.model.presets import PRESETS

    if cfg.model.preset in PRESETS:
        return PRESETS[cfg.model.preset]
    raise ConfigError(f"model.preset={cfg.model.preset!r}: the memory planner needs one of {sorted(PRESETS)}")


@functools.lru_cache(maxsize=16)
def param_table(arch) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    """(shape, logical axes) of every parameter, from abstract shapes (nothing allocated)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(arch, rngs=nnx.Rngs(0), param_dtype=jnp.float32))
    out = []
    for var in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        shape = tuple(var.get_value().shape)
        out.append((shape, tuple(getattr(var, "out_sharding", None) or (None,) * len(shape))))
    return tuple(out)


def shard_elements(table, rules: Sequence[str], axes: dict[str, int]) -> list[int]:
    """Elements of each parameter's shard on one device of a mesh of ``axes`` sizes, by ``rules``."""
    from laminar_jax.learner.mesh import logical_to_spec, parse_rules

    mesh = types.SimpleNamespace(shape=axes)
    rule_table = parse_rules(rules)
    out = []
    for shape, logical in table:
        spec = logical_to_spec(logical, shape, rule_table, mesh)
        split = math.prod(axes[a] for a in spec if a is not None)
        out.append(math.prod(shape) // split)
    return out


def _swapped_elements(table, shards: list[int], num_layers: int) -> list[int]:
    """Elements a weight swap places at once per parameter: a stacked layer parameter (leading layer
    axis, logical axis None) is refilled one layer at a time (rollout/layered.py, refill_stacked)."""
    return [n // num_layers if logical and logical[0] is None and shape[0] == num_layers else n
            for (shape, logical), n in zip(table, shards)]


def learner_axes(cfg, n_devices: int) -> dict[str, int]:
    from laminar_jax.learner.mesh import resolve_mesh_shape

    return dict(zip(("data", "fsdp", "tensor"), resolve_mesh_shape(cfg.mesh, n_devices)))


def kv_bytes(arch, rollout, dtype: str) -> int:
    """The whole page pool of one server: K and V of every layer."""
    return 2 * arch.num_layers * rollout.num_pages * rollout.page_size * arch.num_kv_heads * arch.head_dim * \
        itemsize(dtype)


def learner_rows_per_device(cfg, ranks: int) -> int:
    """Packed rows of one micro-batch on one data rank (at least 1)."""
    rt, ln = cfg.runtime, cfg.learner
    trajectories = rt.prompts_per_step * rt.samples_per_prompt
    per_micro = trajectories / max(1, ln.mini_batches * ln.micro_batches)
    return max(1, math.ceil(per_micro / ranks))


def pack_length(cfg) -> int:
    return cfg.learner.pack_length or cfg.rollout.max_total_len


def activation_bytes(cfg, arch, rows: int) -> int:
    """Activations one gradient pass holds over [rows, pack_length] (abstract shapes; learner/memory.py)."""
    import jax.numpy as jnp

    from laminar_jax.learner.memory import pass_bytes_per_row

    return rows * pass_bytes_per_row(arch, cfg.learner, pack_length(cfg), jnp.dtype(cfg.model.dtype))


def learner_items(cfg, arch, axes: dict[str, int], activations: int, pinned_host: bool) -> dict[str, int]:
    """Bytes of each learner item on one device of the learner mesh of ``axes``."""
    from laminar_jax.learner.logprobs import chunk_positions

    table = param_table(arch)
    shard = sum(shard_elements(table, cfg.mesh.rules, axes))
    p, c = itemsize(cfg.model.param_dtype), itemsize(cfg.model.dtype)
    ranks, tensor = axes["data"] * axes["fsdp"], axes["tensor"]
    # Layers' weights gathered whole over FSDP (split over the tensor axis only): the one computing
    # and the next; without remat every layer's, which its backward pass keeps as residuals.
    # The vocab tables (the embedding, which the token lookup reads gathered, and an untied LM head)
    # are gathered whole for the pass too.
    per_layer = sum(math.prod(s) for s, _ in table if arch.vocab_size not in s) // max(1, arch.num_layers)
    tables = (1 if arch.tie_word_embeddings else 2) * arch.vocab_size * arch.hidden_size
    layers = arch.num_layers if cfg.learner.remat == "none" else min(2, arch.num_layers)
    fsdp = axes["fsdp"] > 1  # nothing to gather unsharded
    gathered = (layers * per_layer + tables) * c // tensor if fsdp else 0
    # The backward makes a gathered layer's gradient whole before its reduce-scatter, one layer at a
    # time. The LM head's (tied or not) is made whole in each log-prob chunk's backward: the float32
    # product and its all-reduce in the compute dtype, of which the chunk keeps its shard (the TPU
    # compiler's peak); the chunk's logits are dead by then, so that phase holds the larger of the two.
    # (learner.lora: the base is frozen, no gradient of the head)
    gathered_grads = per_layer * c // tensor if fsdp else 0
    lm_head = arch.vocab_size * arch.hidden_size
    head_grad = (4 + c) * lm_head // tensor if fsdp and not cfg.learner.lora.enabled else 0
    rows = learner_rows_per_device(cfg, ranks)
    seq = pack_length(cfg)
    chunk = chunk_positions(cfg.learner.logits_chunk_tokens, rows, seq)
    trajectories = cfg.runtime.prompts_per_step * cfg.runtime.samples_per_prompt
    snapshot = cfg.learner.publish_snapshot if cfg.learner.publish_snapshot is not None else pinned_host
    items = {
        "master_params": shard * p,
        "adam_moments": 2 * shard * p,
        "gradients": (2 if cfg.learner.micro_batches > 1 else 1) * shard * p,
        "ref_params": shard * p if cfg.learner.use_kl else 0,
        "compute_copy": (shard * c if c != p else 0) + gathered,
        "gathered_grads": gathered_grads,
        "activations": activations,
        "logprob_chunks": max(3 * rows * chunk * (arch.vocab_size // tensor) * 4, head_grad),
        "batch": 2 * math.ceil(trajectories / ranks) * seq * BATCH_FIELDS_2D * 4,
        "publish_snapshot": shard * itemsize(serving_dtype(cfg)) if snapshot and not pinned_host else 0,
    }
    return lora_items(cfg, arch, axes, items, shard) if cfg.learner.lora.enabled else items


@functools.lru_cache(maxsize=16)
def lora_table(arch, rank: int, targets: tuple[str, ...]) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    """(shape, logical axes) of every adapter tensor of learner.lora (model/lora.py), abstractly."""
    import jax
    from flax import nnx

    from laminar_jax.model.lora import LoRASection, attach
    from laminar_jax.model.transformer import Transformer

    section = LoRASection(rank=rank, targets=targets)
    model = nnx.eval_shape(lambda: attach(Transformer(arch, rngs=nnx.Rngs(0)), section))
    variables = jax.tree.leaves(nnx.state(model, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tuple((tuple(v.get_value().shape), tuple(v.get_metadata()["out_sharding"])) for v in variables)


def lora_items(cfg, arch, axes: dict[str, int], items: dict[str, int], shard: int) -> dict[str, int]:
    """The learner's items under learner.lora (learner/lora.py): master, moments and gradients are the
    float32 adapters'; the base (``shard`` elements here) is frozen in the serving dtype and is the KL
    reference; the pass casts it to the compute dtype only where the two differ; no base gradient is
    gathered; each version is first merged into a device copy of the base (the snapshot's source)."""
    ln = cfg.learner
    adapters = sum(shard_elements(lora_table(arch, ln.lora.rank, tuple(ln.lora.targets)), cfg.mesh.rules, axes))
    p, c, s = itemsize(cfg.model.param_dtype), itemsize(cfg.model.dtype), itemsize(serving_dtype(cfg))
    base_cast = (shard * c if c != p else 0)  # what learner_items counted for the master's compute copy
    return dict(items, master_params=4 * adapters, adam_moments=2 * 4 * adapters,
                gradients=(2 if ln.micro_batches > 1 else 1) * 4 * adapters, ref_params=0, frozen_base=shard * s,
                compute_copy=items["compute_copy"] - base_cast + (shard * c if c != s else 0) + adapters * c,
                gathered_grads=0, publish_snapshot=items["publish_snapshot"] + shard * s)


def rollout_items(cfg, arch, tp: int) -> dict[str, int]:
    """Bytes of each rollout item on one device of a server of TP width ``tp``."""
    from laminar_jax.rollout.tp import TP_RULES

    table = param_table(arch)
    shards = shard_elements(table, TP_RULES, {"tensor": tp})
    s = itemsize(serving_dtype(cfg))
    ro = cfg.rollout
    rows = ro.num_slots
    live = 0
    if ro.attention_impl in ("live_pages", "auto"):  # one layer's live pages gathered into a copy
        live = 2 * rows * ro.pages_per_seq * ro.page_size * (arch.num_kv_heads // tp) * arch.head_dim * \
            itemsize(cfg.model.dtype)
    return {
        "serving_weights": sum(shards) * s,
        "kv_pool": kv_bytes(arch, ro, cfg.model.dtype) // tp,
        # rollout.prefetch_device stages a whole version on the devices before the swap
        "swap_staging": (sum(shards) if getattr(ro, "prefetch_device", False)
                         else max(_swapped_elements(table, shards, arch.num_layers))) * s,
        "decode_temporaries": 3 * rows * arch.vocab_size * 4 + live,
    }


def host_items(cfg, arch) -> dict[str, int]:
    """Host memory of the learner's host (pinned snapshot) and of each relay (kept versions)."""
    version = sum(math.prod(s) for s, _ in param_table(arch)) * itemsize(serving_dtype(cfg))
    return {"pinned_snapshot": version, "relay_versions": cfg.relay.keep_in_memory * version}


def host_layout(cfg, devices: int) -> Layout:
    """The layout on a host of ``devices`` accelerators: the local runtime's placement; under Ray
    (runtime.kind='ray'), the learner's devices (placement.learner_devices, else the whole host)
    and one rollout actor's own rollout_tp devices beside them (every actor is alike)."""
    if cfg.runtime.kind != "ray":
        return plan_layout(cfg.placement, devices, cfg.runtime.num_servers)
    n = cfg.placement.learner_devices or devices
    return Layout(tuple(range(n)), (tuple(range(n, n + cfg.placement.rollout_tp)),))


def device_items(cfg, layout: Layout, arch, activations: Optional[int] = None,
                 pinned_host: bool = True) -> dict[int, dict[str, int]]:
    """Items per device index of the layout; colocated roles add up on a shared device."""
    axes = learner_axes(cfg, len(layout.learner))
    if activations is None:
        activations = activation_bytes(cfg, arch, learner_rows_per_device(cfg, axes["data"] * axes["fsdp"]))
    learner = learner_items(cfg, arch, axes, activations, pinned_host)
    server = rollout_items(cfg, arch, cfg.placement.rollout_tp)
    out: dict[int, dict[str, int]] = {}
    for d in layout.learner:
        out[d] = dict(learner)
    for s in layout.servers:
        for d in s:
            had = out.setdefault(d, {})
            for k, v in server.items():
                had[k] = had.get(k, 0) + v
    return out


def budget_of(accelerator: str, fraction: float) -> tuple[float, float]:
    """(device bytes, the budget XLA's allocator gets of them)."""
    total, kind = ACCELERATORS[accelerator]
    return total, total * (fraction if kind == "gpu" else 1.0)


def largest(items: dict[str, int], n: int = 3) -> list[tuple[str, int]]:
    return sorted(((k, v) for k, v in items.items() if v), key=lambda kv: -kv[1])[:n]


def report(cfg, accelerator: str, devices: int = 8, activations: Optional[int] = None, margin: float = MARGIN,
           arch=None) -> dict:
    """Per-device items of ``cfg`` on a host of ``devices`` x ``accelerator`` and the verdict."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator {accelerator!r}: one of {sorted(ACCELERATORS)}")
    total, budget = budget_of(accelerator, cfg.runtime.gpu_memory_fraction)
    arch = arch or arch_of(cfg)
    layout = host_layout(cfg, devices)
    per = device_items(cfg, layout, arch, activations)
    need = {d: sum(v.values()) for d, v in per.items()}
    worst = max(need, key=need.get)
    rows = [{"device": d, "role": role_of(layout, d), "items": per[d], "total_gb": need[d] / GB,
             "headroom": 1 - need[d] / budget} for d in sorted(per)]
    return {"accelerator": accelerator, "device_gb": total / GB, "budget_gb": budget / GB,
            "reserve_gb": (total - budget) / GB, "devices": devices, "layout": layout.to_json(),
            "params": arch.num_params(), "rows": rows, "worst_device": worst, "worst_gb": need[worst] / GB,
            "headroom": 1 - need[worst] / budget, "fits": need[worst] <= (1 - margin) * budget, "margin": margin,
            "largest": largest(per[worst]), "host_gb": {k: v / GB for k, v in host_items(cfg, arch).items()}}


def role_of(layout: Layout, d: int) -> str:
    roles = (["learner"] if d in layout.learner else []) + \
        [f"server{i}" for i, s in enumerate(layout.servers) if d in s]
    return "+".join(roles)


def format_report(r: dict) -> str:
    head = (f"{r['devices']} x {r['accelerator']} ({r['device_gb']:.0f} GB each; budget {r['budget_gb']:.1f} GB, "
            f"allocator reserve {r['reserve_gb']:.1f} GB), {r['params'] / 1e9:.2f}B params, layout {r['layout']}")
    cols = ("master_params", "adam_moments", "gradients", "compute_copy", "activations", "serving_weights",
            "kv_pool")
    lines = [head, f"{'device':>6} {'role':<10} " + " ".join(f"{c[:12]:>12}" for c in cols) +
             f" {'other':>8} {'total GB':>9} {'headroom':>9}"]
    for row in r["rows"]:
        it = row["items"]
        other = sum(v for k, v in it.items() if k not in cols)
        lines.append(f"{row['device']:>6} {row['role']:<10} " +
                     " ".join(f"{it.get(c, 0) / GB:>12.1f}" for c in cols) +
                     f" {other / GB:>8.1f} {row['total_gb']:>9.1f} {row['headroom']:>9.0%}")
    host = r["host_gb"]
    lines.append(f"host: pinned publish snapshot {host['pinned_snapshot']:.1f} GB, relay versions "
                 f"{host['relay_versions']:.1f} GB per relay")
    big = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in r["largest"])
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: device {r['worst_device']} needs {r['worst_gb']:.1f} GB of its {r['budget_gb']:.1f} GB "
                 f"budget ({r['headroom']:.0%} headroom, {r['margin']:.0%} required; largest: {big})")
    return "\n".join(lines)


def fits_summary(cfg, devices: int = 8) -> dict[str, bool]:
    """Verdict per accelerator (one activation estimate shared)."""
    arch = arch_of(cfg)
    layout = host_layout(cfg, devices)
    axes = learner_axes(cfg, len(layout.learner))
    act = activation_bytes(cfg, arch, learner_rows_per_device(cfg, axes["data"] * axes["fsdp"]))
    return {a: report(cfg, a, devices, activations=act)["fits"] for a in ACCELERATORS}


def fit_errors(per: dict[int, dict[str, int]], limits: dict[int, Optional[int]], margin: float = 0.0) -> list[str]:
    """One message per device whose plan exceeds its reported budget (None: not reported, skipped),
    naming the device, the budget, the largest items and the config key of the largest."""
    out = []
    for d, items in sorted(per.items()):
        lim, need = limits.get(d), sum(items.values())
        if lim is None or need <= (1 - margin) * lim:
            continue
        big = largest(items)
        out.append(f"device {d}: needs {need / 2**30:.2f} GiB of its {lim / 2**30:.2f} GiB budget (bytes_limit: "
                   f"runtime.gpu_memory_fraction of the device); largest: "
                   + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in big) + f"; change {ITEM_KEYS[big[0][0]]}")
    return out


def shipped_table() -> str:
    """The markdown table of every shipped accelerator config's verdict (docs/DEPLOY.md holds its output)."""
    from laminar_jax.config import finalize, repo_config

    lines = ["| config | accelerator | budget per device | worst device | planned | headroom | largest items | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for name, variant, acc, devices in SHIPPED:
        r = report(finalize(repo_config(name, variant)), acc, devices)
        big = ", ".join(f"{k} {v / GB:.1f}" for k, v in r["largest"])
        lines.append(f"| `{name}{':' + variant if variant else ''}` | {devices} x {acc} | {r['budget_gb']:.1f} GB | "
                     f"{r['worst_device']} ({r['rows'][r['worst_device']]['role']}) | {r['worst_gb']:.1f} GB | "
                     f"{r['headroom']:.0%} | {big} | {'FITS' if r['fits'] else 'DOES NOT FIT'} |")
    return "\n".join(lines)


def check_devices(cfg, layout: Layout, devices: Sequence[Any], arch) -> None:
    """Fail at start, before anything compiles, when a device's plan exceeds its budget
    (``memory_stats()['bytes_limit']``; backends that report none, such as CPU, are not checked)."""
    from laminar_jax.configlib import ConfigError
    from laminar_jax.placement import bytes_limits

    limits = bytes_limits(devices)
    if all(v is None for v in limits.values()):
        return
    platform = devices[0].platform
    per = device_items(cfg, layout, arch, pinned_host=platform != "cpu")
    errors = fit_errors(per, limits)
    if errors:
        raise ConfigError("placement: the run does not fit its devices (launch/plan.py memory shows every item):\n  "
                          + "\n  ".join(errors))


def check_server_devices(cfg, devices: Sequence[Any], arch, server: str = "rollout server") -> None:
    """A rollout server's own start check (a Ray rollout actor, a rollout child process: they see
    only their own devices): each device's share of one server (``rollout_items`` at TP width
    len(devices)) against its budget, failing before the engine allocates or compiles anything,
    naming the server, the device, the budget, the largest items and the key to change."""
    from laminar_jax.configlib import ConfigError
    from laminar_jax.placement import bytes_limits

    limits = bytes_limits(devices)
    if all(v is None for v in limits.values()):
        return
    items = rollout_items(cfg, arch, len(devices))
    errors = fit_errors({d: items for d in range(len(devices))}, limits)
    if errors:
        raise ConfigError(f"placement: {server} does not fit its devices (launch/plan.py memory shows every item):"
                          "\n  " + "\n  ".join(errors))


__all__ = ["ACCELERATORS", "check_server_devices", "ITEM_KEYS", "report", "format_report", "fits_summary", "device_items", "kv_bytes",
           "check_devices", "fit_errors", "learner_items", "rollout_items", "host_items", "serving_dtype"]
