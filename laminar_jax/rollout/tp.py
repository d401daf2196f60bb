"""Tensor-parallel layout of a rollout engine: weights and KV pages over a Mesh with a 'tensor' axis.

Megatron layout, expressed as shardings and left to GSPMD to partition:
  - q/k/v and gate/up weights ([out, in]) are split by output rows ('heads', 'kv_heads', 'mlp'),
  - o and down weights by input columns (the same logical names on their second axis),
  - the embedding (and an untied LM head) over the vocabulary ('vocab'),
  - norms replicated.
So each device computes its own heads' attention against its own KV heads, and the layer does one
all-reduce after o and one after down. The KV pools (in the layout the decode attention reads)
are split on Hkv, which is why the KV-head count must divide by the TP width. The page table and
the per-slot sampling state are replicated: every device runs the same host-visible bookkeeping.

The layout never leaves the devices: read_slot() gathers pages to plain host arrays
(f[L, n, page, Hkv, D]), so a live sequence moves between engines of any TP width.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from laminar_jax.model.arch import TransformerConfig

TP_AXIS = "tensor"
# Logical parameter axes (see laminar_jax.model.transformer) -> the tensor axis.
TP_RULES = ("heads=tensor", "kv_heads=tensor", "mlp=tensor", "vocab=tensor")


def tp_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis ('tensor') mesh over a server's devices (one device = TP 1 on that device)."""
    devices = list(devices)
    if not devices:
        raise ValueError("tp_mesh: a rollout server needs at least one device")
    return Mesh(np.asarray(devices, dtype=object), (TP_AXIS,))


def tp_width(mesh: Mesh) -> int:
    if TP_AXIS not in mesh.shape:
        raise ValueError(f"rollout engine mesh has axes {tuple(mesh.shape)}; it needs a '{TP_AXIS}' axis")
    other = {k: v for k, v in mesh.shape.items() if k != TP_AXIS and v != 1}
    if other:
        raise ValueError(f"rollout engine mesh: only the '{TP_AXIS}' axis may exceed 1, got {dict(mesh.shape)}")
    return int(mesh.shape[TP_AXIS])


def check_tp(cfg: TransformerConfig, tp: int) -> None:
    """Heads split evenly over the TP width, or a clear error naming both numbers."""
    if cfg.num_kv_heads % tp:
        raise ValueError(f"rollout TP width {tp} does not divide the model's KV-head count num_kv_heads="
                         f"{cfg.num_kv_heads} (KV pages are split on the KV-head axis)")
    if cfg.num_heads % tp:
        raise ValueError(f"rollout TP width {tp} does not divide the model's head count num_heads={cfg.num_heads}")


def param_shardings_list(params: Any, mesh: Mesh) -> list:
    """One NamedSharding per leaf of ``jax.tree.leaves(params)`` (params: the model's nnx.State)."""
    from laminar_jax.model.axes import param_shardings

    return jax.tree.leaves(param_shardings(params, mesh, TP_RULES))


def kv_sharding(mesh: Mesh, ndim: int = 5) -> NamedSharding:
    """Exported KV pages f[..., page, Hkv, D] split on their KV-head axis (second from last)."""
    return NamedSharding(mesh, P(*([None] * (ndim - 2)), TP_AXIS, None))


def pool_sharding(mesh: Mesh, layout: str = "split") -> NamedSharding:
    """A KV pool of ``layout`` (rollout.attention, "pool layouts") split on its KV-head axis."""
    from laminar_jax.rollout.attention import head_axis

    spec = [None] * 4
    spec[head_axis(layout)] = TP_AXIS
    return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place_leaf(x: Any, sharding: NamedSharding) -> jax.Array:
    """One array onto ``sharding``: a host array sends each device only its own shard; a device
    array already there is returned as is; any other device array is resharded device to device."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if not x.is_fully_addressable or x.is_deleted():
            raise ValueError(f"cannot place array of sharding {x.sharding} onto {sharding}")
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def place_leaves(leaves: list, shardings: list) -> list:
    return [place_leaf(x, s) for x, s in zip(leaves, shardings)]


def devices_of(tree: Any) -> set:
    """Every device holding a piece of any array in ``tree`` (for placement checks)."""
    out: set = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            out |= set(x.sharding.device_set)
    return out


def constrain(tree: Any, shardings: Optional[Any]) -> Any:
    """with_sharding_constraint when the engine has a layout (traced code), else the tree unchanged."""
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)
