"""The head-major KV pool layout the Pallas decode kernels read, and what they share.

JAX's paged decode kernels for GPU (``pallas.ops.gpu.paged_attention``, Triton) and TPU
(``pallas.ops.tpu.paged_attention``, Mosaic) both take one layer's pools as K and V each
f[Hkv, P, page, D]: a grid step owns one KV head and walks that head's pages, so the head axis
leads. The engine's CPU pools (rollout/attention.py, "pool layouts") keep K [P, Hkv, D, page] and
V [P, Hkv, page, D]; converting between the two per step would copy the whole pool, so a kernel
that reads this layout declares it (``POOL_LAYOUT``) and the engine allocates its pools so.
Outside the engine pages stay f[n, page, Hkv, D] (``to_pool`` / ``from_pool`` convert), as for the
CPU layout.

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

from laminar_jax.rollout.attention import DecodeMeta, as_stored, from_stored

POOL_LAYOUT = "head_major"  # K and V pools f[Hkv, P, page, D]


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
    del key  # K and V share the layout
    return (hkv, num_pages, page, d)


def to_pool(x: jax.Array, *, key: bool = True) -> jax.Array:
    """Pages f[n, page, Hkv, D] -> the head-major layout f[Hkv, n, page, D]."""
    del key
    return jnp.transpose(x, (2, 0, 1, 3))


def from_pool(x: jax.Array, *, key: bool = True) -> jax.Array:
    """The inverse of to_pool: f[Hkv, n, page, D] -> f[n, page, Hkv, D]."""
    del key
    return jnp.transpose(x, (1, 2, 0, 3))


def write_token(pages: jax.Array, new: jax.Array, meta: DecodeMeta) -> jax.Array:
    """Write one token per row (new f[B, Hkv, D]) into a head-major pool; inactive rows hit page 0."""
    b = new.shape[0]
    page = meta.page_table[jnp.arange(b), meta.positions // meta.page_size]
    page = jnp.where(meta.active, page, 0)
    offset = meta.positions % meta.page_size
    # pages[:, page[b], offset[b], :] = new[b]: the two adjacent index arrays leave B at axis 1 ([Hkv, B, D]).
    return pages.at[:, page, offset, :].set(jnp.swapaxes(as_stored(new, meta.kv_dtype), 0, 1))


def write_kv(layer_cache, k: jax.Array, v: jax.Array, meta: DecodeMeta) -> tuple[jax.Array, jax.Array]:
    return write_token(layer_cache[0], k[:, 0], meta), write_token(layer_cache[1], v[:, 0], meta)


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
        def local(q, k, v, kp, vp, table, positions, active):
            m = meta._replace(page_table=table, positions=positions, active=active, live=None)
            return backend(q, k, v, (kp, vp), meta=m)

        smap = getattr(jax, "shard_map", None)
        if smap is None:  # jax < 0.7 keeps it under experimental
            from jax.experimental.shard_map import shard_map as smap
        fn = smap(local, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, P(), P(), P()),
                  out_specs=(heads, (pool, pool)), check_vma=False)
        return fn(q, k, v, layer_cache[0], layer_cache[1], meta.page_table, meta.positions, meta.active)

    return run
