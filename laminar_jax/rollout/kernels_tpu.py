"""TPU decode attention: JAX's Pallas Mosaic paged attention kernel (``jax.experimental.pallas.ops.tpu.paged_attention``).

Why this kernel and not ``ragged_paged_attention``: both are JAX's own and both compile for a v5e
(ahead of time, launch/tpu_aot.py). The ragged kernel serves mixed prefill and decode over one
combined pool f[P, page, 2 * Hkv, D] (K and V heads interleaved); the engine keeps separate K and V
pools per layer and decodes one token per row, which is exactly ``paged_attention``'s contract:
q f[B, H, D], K and V pools f[Hkv, P, page, D] (the head-major layout the GPU kernel reads too,
rollout/head_major.py), a page table and ragged lengths. A grid step owns one (row, KV head) and
DMAs only the pages that row's length covers, ``pages_per_compute_block`` at a time, double
buffered, with an online softmax: per step the KV bytes read are the live KV rounded up to a
block of pages.

Limits at JAX 0.10.2 (found by lowering for a v5e): head_dim a multiple of 128 (a lane tile; the
64 of Qwen2.5-0.5B fails Mosaic's block-shape check, and the ragged kernel asserts on it as well),
page_size a multiple of 8 (16 for 16-bit KV: a sublane tile), the page table a multiple of the
pages per block. ``interpret=True`` runs it on CPU (tests) under ``pltpu.force_tpu_interpret_mode``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp

from laminar_jax.rollout import head_major
from laminar_jax.rollout import kernels as seam
from laminar_jax.rollout.attention import DecodeMeta

NAME = "pallas_tpu_paged"
POOL_LAYOUT = head_major.POOL_LAYOUT
# The kernel rounds the K and V it loads to bfloat16 whatever the pool's dtype (its
# ``_maybe_dequantize``): a float32 pool would be read at twice the bytes and computed at bf16
# precision, so supports() takes bfloat16 KV only (an f32 pool runs, to bf16 tolerance: tests).
FLOAT_KV = (jnp.bfloat16,)


def pages_per_block(pages_per_seq: int, page_size: int) -> int:
    """Pages one DMA block holds: up to 128 tokens (a lane tile of scores per step), dividing the table."""
    return head_major.largest_pow2_divisor(pages_per_seq, max(1, 128 // page_size))


def supports(geometry) -> tuple[bool, str]:
    """Whether the kernel can serve this engine, and why not (a DecodeGeometry, or the kernel seam's
    geometry, read as on TPU: head_major.as_geometry)."""
    g = head_major.as_geometry(geometry, "tpu")
    if g.platform != "tpu":
        return False, f"runs on TPUs, not {g.platform}"
    dtype = jnp.dtype(g.kv_dtype)
    if dtype not in [jnp.dtype(t) for t in FLOAT_KV]:
        return False, f"KV dtype {dtype}: the kernel computes in bfloat16 (use a bfloat16 KV cache)"
    if g.head_dim % 128:
        return False, f"head_dim={g.head_dim} must be a multiple of 128 (a TPU lane tile)"
    if g.num_heads % g.num_kv_heads:
        return False, f"{g.num_heads} query heads not a multiple of {g.num_kv_heads} KV heads"
    sublanes = 8 * (4 // dtype.itemsize)
    if g.page_size % sublanes:
        return False, f"page_size={g.page_size} must be a multiple of {sublanes} for {dtype} KV"
    return True, ""


def refuses(geometry) -> Optional[str]:
    """The kernel seam's check: why the kernel cannot serve ``geometry``, or None."""
    ok, why = supports(geometry)
    return None if ok else why


def _tpu_paged_attention():
    """JAX's TPU paged attention function (guarded: a moved module is an ImportError, so the plugin is
    skipped and 'auto' falls back)."""
    try:
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    except ImportError:
        from jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel import paged_attention
    return paged_attention


def make_decode(*, interpret: bool = False, megacore_mode: Optional[str] = None):
    """The decode backend (``head_major`` contract) over JAX's TPU paged attention.

    ``interpret``: run it in Pallas's TPU interpreter (tests on the CPU); never set on a TPU.
    ``megacore_mode``: None on one TensorCore per chip (v5e, v6e); 'kv_head' or 'batch' splits the
    grid over v4/v5p's two cores (the kernel may hang if set without megacore)."""
    from jax.experimental.pallas import tpu as pltpu

    paged_attention = _tpu_paged_attention()

    def pallas_tpu_paged(q, k, v, layer_cache, *, meta: DecodeMeta):
        k_pages, v_pages = head_major.write_kv(layer_cache, k, v, meta)
        kv, vv = head_major.pools_as_values((k_pages, v_pages), meta.kv_dtype)
        b, _, h, d = q.shape
        length = head_major.lengths(meta)
        mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
        # The kernel's products take bf16 K/V; a process-wide 'highest' matmul precision (f32 runs set
        # it) would ask Mosaic for f32 x f32 products it rejects ("Bad rhs type").
        with mode, jax.default_matmul_precision("default"):
            out = paged_attention(head_major.scaled_query(q, kv.dtype), kv, vv, length,
                                  meta.page_table.astype(jnp.int32), megacore_mode=megacore_mode,
                                  pages_per_compute_block=pages_per_block(meta.page_table.shape[1], meta.page_size))
        out = jnp.where((length > 0)[:, None, None], out, 0)  # a row with no tokens: zeros, not 0/0
        return out.reshape(b, 1, h, d).astype(q.dtype), (k_pages, v_pages)

    pallas_tpu_paged.pool_layout = POOL_LAYOUT
    pallas_tpu_paged.per_shard = True
    return pallas_tpu_paged


# The seam loads this module for 'tpu' (laminar_jax.kernels.PLUGINS): 'auto' takes the kernel on a TPU
# wherever refuses() lets it, above the portable live_pages.
seam.register_attention(seam.AttentionKernel(NAME, make_decode(), refuses, auto_rank=10, pool_layout=POOL_LAYOUT,
                                             per_shard=True), "tpu")
