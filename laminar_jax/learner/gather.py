"""A multi-process learner's weights gathered to the one process that publishes them.

Each process holds only its shards of a parameter; the publisher (process 0) needs the whole
tensor on its host. An all-gather (``multihost_utils.process_allgather``) gives every process a
full copy, and replicates the tensor onto every device on the way. Here each parameter makes one
trip, tensor by tensor:

  1. spread: the tensor, flattened and padded, is split evenly over every device of the mesh, in
     the mesh's own device order (a redistribution: each byte moves at most once);
  2. gather: in a shard_map over a ('proc', 'local') view of the same devices, the block of
     device (p, l) is sent to device (root, l) by one collective permute per process p, so each of
     the root's devices ends up with the blocks of its local index from every process;
  3. the root reads its own devices' blocks into one host array; the other processes read nothing.

So the bytes crossing processes are the tensor once, the root's devices hold 1/L of the tensor
each (L = devices per process), and no process but the root builds a host copy. A mesh whose
device order does not group each process's devices together falls back to the all-gather, one
tensor at a time.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_AXES = ("proc", "local")


def gather_to_root(flat: dict, root: int = 0) -> Optional[dict]:
    """Collective (every process calls it with the same names): {name: host array} on process
    ``root``, None on the others. Single-process arrays are copied to the host directly."""
    mine = jax.process_index() == root
    out: Optional[dict] = {} if mine else None
    for name, x in flat.items():
        host = gather_one(x, root)
        if mine:
            out[name] = host
    return out


def gather_one(x: jax.Array, root: int = 0) -> Optional[np.ndarray]:
    """One parameter's full value on process ``root``'s host (None on the others)."""
    mine = jax.process_index() == root
    if x.is_fully_addressable:
        return np.asarray(x) if mine else None
    if x.sharding.is_fully_replicated:  # every process holds it whole already: no traffic
        return np.asarray(x.addressable_data(0)) if mine else None
    mesh = getattr(x.sharding, "mesh", None)
    mesh = None if mesh is None else _process_mesh(tuple(mesh.devices.flat))
    if mesh is None:
        from jax.experimental import multihost_utils

        full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return full if mine else None
    n, per = mesh.devices.shape
    padded = -(-x.size // (n * per)) * (n * per)
    root_row = [int(i) for i, row in enumerate(mesh.devices) if row[0].process_index == root][0]
    spread, gather = _programs(mesh, x.shape, str(x.dtype), padded, root_row)
    out = gather(spread(x))
    if not mine:
        return None
    block = padded // (n * per)
    host = np.empty(padded, x.dtype)
    for shard in out.addressable_shards:  # the root's devices: [n, block] each, one block per process
        d = shard.index[0].start // n  # the device's position in the mesh's flat order
        local = d - root_row * per
        data = np.asarray(shard.data)
        for p in range(n):
            start = (p * per + local) * block
            host[start:start + block] = data[p]
    return host[:x.size].reshape(x.shape)


@functools.lru_cache(maxsize=16)
def _process_mesh(devices: tuple) -> Optional[Mesh]:
    """('proc', 'local') over ``devices`` in their order, if that order groups each process's
    devices together in equal numbers; else None."""
    procs = sorted({d.process_index for d in devices})
    per = len(devices) // len(procs)
    if per * len(procs) != len(devices):
        return None
    grid = np.asarray(devices, dtype=object).reshape(len(procs), per)
    if any(len({d.process_index for d in row}) != 1 for row in grid):
        return None
    return Mesh(grid, _AXES)


@functools.lru_cache(maxsize=256)
def _programs(mesh: Mesh, shape: tuple, dtype: str, padded: int, root: int):
    """(spread, gather) for one parameter shape; compiled once per shape (a model has few)."""
    n, per = mesh.devices.shape
    flat = NamedSharding(mesh, P(_AXES))

    def pad(x):
        f = x.reshape(-1)
        return jnp.pad(f, (0, padded - f.size))

    def body(block):  # this device's [padded / (n * per)] block
        rows = [block if p == root else
                jax.lax.ppermute(block, _AXES, perm=[(p * per + i, root * per + i) for i in range(per)])
                for p in range(n)]
        return jnp.stack(rows)  # on the root's devices: the blocks of this local index from every process

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map
    gather = shard_map(body, mesh=mesh, in_specs=P(_AXES), out_specs=P(_AXES))
    return jax.jit(pad, out_shardings=flat), jax.jit(gather, out_shardings=flat)
