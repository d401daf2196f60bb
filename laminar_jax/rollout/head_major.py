"""The head-major KV pool layout the Pallas decode kernels read, and what they share.

JAX's paged decode kernels for GPU (``pallas.ops.gpu.paged_attention``, Triton) and TPU
(``pallas.ops.tpu.paged_attention``, Mosaic) both take one layer's pools as K and V each
f[Hkv, P, page, D]: a grid step owns one KV head and walks that head's pages, so the head axis
leads. The engine's CPU pools (rollout/attention.py, "pool layouts") keep K [P, Hkv, D, page] and
V [P, Hkv, page, D]; converting between the two per step would copy the whole pool, so a kernel
that reads this layout declares it (``POOL_LAYOUT``) and the engine allocates its pools so (the
layout's shape, storage and indexing live with the others in rollout/attention.py, "pool layouts").
Outside the engine pages stay f[n, page, Hkv, D] (``to_pool`` / ``from_pool`` convert), as for the
CPU layout, so a sequence exported from one layout imports into the other.

Decode backends here keep the contract of ``attention.live_pages``:
``backend(q, k, v, layer_cache, *, meta) -> (out, (k_pages, v_pages))``, q f[B, 1, H, D],
k/v f[B, 1, Hkv, D]: write the token at ``meta.positions`` (inactive rows into the null page 0),
then each active row attends over its first ``positions + 1`` tokens; inactive rows give zeros.

``DecodeGeometry`` is what a kernel's ``supports(geometry) -> (bool, reason)`` reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from laminar_jax.rollout import attention
from laminar_jax.rollout.attention import DecodeMeta, from_stored

POOL_LAYOUT = attention.HEAD_MAJOR  # K and V pools f[Hkv, P, page, D], stored in the KV dtype


class DecodeGeometry(NamedTuple):
    """What decides whether a decode kernel can serve an engine (per device: under tensor
    parallelism ``num_heads`` and ``num_kv_heads`` are one shard's)."""

    platform: str  # 'cpu', 'gpu', 'tpu'
    kv_dtype: Any
    page_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    pages_per_seq: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def as_geometry(g: Any, platform: str) -> DecodeGeometry:
    """A DecodeGeometry from ``g``: one already, or the kernel seam's geometry (global ``heads``,
    ``kv_heads``, ``dtype``, ``tensor_parallel`` width: each shard gets heads / width), on ``platform``."""
    if isinstance(g, DecodeGeometry):
        return g
    tp = max(int(getattr(g, "tensor_parallel", 1) or 1), 1)
    return DecodeGeometry(platform, g.dtype, g.page_size, g.head_dim, g.heads // tp, g.kv_heads // tp,
                          int(getattr(g, "pages_per_seq", 0) or 0))


def pool_shape(num_pages: int, page: int, hkv: int, d: int, *, key: bool = True) -> tuple[int, ...]:
    return attention.pool_shape(num_pages, page, hkv, d, key=key, layout=POOL_LAYOUT)


def to_pool(x: jax.Array, *, key: bool = True) -> jax.Array:
    """Pages f[n, page, Hkv, D] -> the head-major layout f[Hkv, n, page, D]."""
    return attention.to_pool(x, key=key, layout=POOL_LAYOUT)


def from_pool(x: jax.Array, *, key: bool = True) -> jax.Array:
    """The inverse of to_pool: f[Hkv, n, page, D] -> f[n, page, Hkv, D]."""
    return attention.from_pool(x, key=key, layout=POOL_LAYOUT)


def write_kv(layer_cache, k: jax.Array, v: jax.Array, meta: DecodeMeta) -> tuple[jax.Array, jax.Array]:
    """The token written into one layer's head-major pools (inactive rows into its null page, first_page)."""
    return attention.write_kv(layer_cache, k, v, meta, layout=POOL_LAYOUT)


def lengths(meta: DecodeMeta) -> jax.Array:
    """i32[B]: tokens each row attends (its position + 1), 0 for inactive rows."""
    return jnp.where(meta.active, meta.positions + 1, 0).astype(jnp.int32)


def scaled_query(q: jax.Array, kv_dtype) -> jax.Array:
    """q f[B, 1, H, D] -> f[B, H, D] times 1/sqrt(D), in the KV dtype: neither kernel scales the
    logits, and Triton's dot wants both operands in one dtype."""
    b, _, h, d = q.shape
    return (q.reshape(b, h, d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d)))).astype(kv_dtype)


def pools_as_values(layer_cache, kv_dtype) -> tuple[jax.Array, jax.Array]:
    """The pools as kv_dtype values (a pool stored as uint16 bits is bitcast, not copied)."""
    return from_stored(layer_cache[0], kv_dtype), from_stored(layer_cache[1], kv_dtype)


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n (1 when n is odd)."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def shard_over_kv_heads(backend, mesh: jax.sharding.Mesh, axis: str):
    """A decode backend run per tensor-parallel shard (``jax.shard_map``): q split on its heads,
    k/v and the head-major pools on their KV heads, the page table and lengths replicated.

    Why: a Pallas kernel is one custom call that XLA cannot partition; each shard attends its own
    KV heads (whole GQA groups), so no collective is needed. The output stays split on heads, as
    the o-projection's input is under TP.
    """
    from jax.sharding import PartitionSpec as P

    heads = P(None, None, axis, None)
    pool = P(axis, None, None, None)

    def run(q, k, v, layer_cache, *, meta: DecodeMeta):
        def local(q, k, v, kp, vp, table, positions, active, first_page):
            m = meta._replace(page_table=table, positions=positions, active=active, live=None, first_page=first_page)
            return backend(q, k, v, (kp, vp), meta=m)

        smap = getattr(jax, "shard_map", None)
        if smap is None:  # jax < 0.7 keeps it under experimental
            from jax.experimental.shard_map import shard_map as smap
        fn = smap(local, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, P(), P(), P(), P()),
                  out_specs=(heads, (pool, pool)), check_vma=False)
        return fn(q, k, v, layer_cache[0], layer_cache[1], meta.page_table, meta.positions, meta.active,
                  jnp.asarray(meta.first_page, jnp.int32))

    return run
