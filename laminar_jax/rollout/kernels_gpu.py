"""GPU decode attention: JAX's Pallas paged attention kernel (``jax.experimental.pallas.ops.gpu.paged_attention``).

Why this kernel (tokamax 0.0.12 and JAX 0.10.2, read at the source):
- tokamax's attention ops (``tokamax.dot_product_attention``: Mosaic GPU on sm90/sm100, Triton,
  cuDNN) are training/prefill kernels: on GPU every one raises "Paged attention not supported" for a
  ``PagingInfo``; its only paged path is ``xla_chunked`` (plain XLA, a gather per chunk).
- ``pallas.ops.gpu.decode_attention`` is ragged (start/end per row) and GQA, but over a contiguous
  [B, S, Hkv, D] cache: our pages would have to be gathered into a copy first, which is the cost the
  kernel exists to avoid.
- ``pallas.ops.gpu.paged_attention`` reads pages in place through the page table, takes ragged
  lengths (a row reads only the pages its length covers, in ``k_splits`` partitions run in parallel
  and merged flash-style), GQA (a program owns one KV head and a block of 16 of its query heads),
  any float dtype (bf16 pools with a bf16 query), and int8 pools with scales. It is Triton, so it
  runs on every CUDA GPU JAX supports (Ampere, Hopper, Blackwell), and it is maintained in JAX
  itself, so it moves with the jax version we pin. Its limits: Triton wants power-of-two tiles, so
  head_dim and ``pages_per_compute_block * page_size`` must be powers of two of at least 16, and
  query heads are padded to blocks of 16 (G = 7 computes 16 rows, reads K/V once).

The pools are head-major (rollout/head_major.py). ``interpret=True`` runs the kernel on CPU
(tests). Under tensor parallelism the engine wraps it with ``head_major.shard_over_kv_heads``.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from laminar_jax.rollout import head_major
from laminar_jax.rollout import kernels as seam
from laminar_jax.rollout.attention import DecodeMeta

NAME = "pallas_gpu_paged"
POOL_LAYOUT = head_major.POOL_LAYOUT
FLOAT_KV = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def tiling(pages_per_seq: int, page_size: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for a page table of ``pages_per_seq`` pages: up to 16
    partitions of the sequence (parallel programs; the kernel needs them to divide the table) and up
    to 8 pages per block, at least 16 tokens a block (Triton's smallest dot)."""
    k_splits = head_major.largest_pow2_divisor(pages_per_seq, 16)
    per_split = pages_per_seq // k_splits
    pages = head_major.largest_pow2_divisor(per_split, max(8, -(-16 // page_size)))
    while pages * page_size < 16 and k_splits > 1:  # merge partitions until a block holds 16 tokens
        k_splits //= 2
        pages = head_major.largest_pow2_divisor(pages_per_seq // k_splits, max(8, -(-16 // page_size)))
    return k_splits, pages


def supports(geometry) -> tuple[bool, str]:
    """Whether the kernel can serve this engine, and why not (a DecodeGeometry, or the kernel seam's
    geometry, read as on GPU: head_major.as_geometry)."""
    g = head_major.as_geometry(geometry, "gpu")
    if g.platform not in ("gpu", "cuda"):
        return False, f"runs on NVIDIA GPUs, not {g.platform}"
    if jnp.dtype(g.kv_dtype) not in [jnp.dtype(t) for t in FLOAT_KV]:
        return False, f"KV dtype {jnp.dtype(g.kv_dtype)} (float32, bfloat16 or float16)"
    if not (_pow2(g.head_dim) and g.head_dim >= 16):
        return False, f"head_dim={g.head_dim} must be a power of two >= 16 (Triton tiles)"
    if g.num_heads % g.num_kv_heads:
        return False, f"{g.num_heads} query heads not a multiple of {g.num_kv_heads} KV heads"
    if not _pow2(g.page_size):
        return False, f"page_size={g.page_size} must be a power of two (Triton tiles)"
    _, pages = tiling(g.pages_per_seq, g.page_size)
    if pages * g.page_size < 16:
        return False, f"page_size={g.page_size} x {g.pages_per_seq} pages per sequence: no 16-token block"
    return True, ""


def refuses(geometry) -> Optional[str]:
    """The kernel seam's check: why the kernel cannot serve ``geometry``, or None."""
    ok, why = supports(geometry)
    return None if ok else why


def _gpu_paged_attention():
    """JAX's GPU paged attention module (its path has held from jax 0.4 to 0.11; a move is an ImportError,
    so the plugin is skipped and 'auto' falls back)."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention
    except ImportError:  # a later layout of the ops package
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention_kernel as paged_attention
    return paged_attention


def make_decode(*, interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """The decode backend (``head_major`` contract) over JAX's GPU paged attention.

    ``interpret``: run it in Pallas's interpreter (tests on the CPU); never set on a GPU."""
    gpu_paged = _gpu_paged_attention()

    def pallas_gpu_paged(q, k, v, layer_cache, *, meta: DecodeMeta):
        k_pages, v_pages = head_major.write_kv(layer_cache, k, v, meta)
        kv, vv = head_major.pools_as_values((k_pages, v_pages), meta.kv_dtype)
        b, _, h, d = q.shape
        k_splits, pages = tiling(meta.page_table.shape[1], meta.page_size)
        out = gpu_paged.paged_attention(
            head_major.scaled_query(q, kv.dtype), kv, vv, meta.page_table.astype(jnp.int32),
            head_major.lengths(meta), block_h=16, pages_per_compute_block=pages, k_splits=k_splits,
            num_warps=num_warps, num_stages=num_stages, interpret=interpret)
        return out.reshape(b, 1, h, d).astype(q.dtype), (k_pages, v_pages)

    pallas_gpu_paged.pool_layout = POOL_LAYOUT
    pallas_gpu_paged.per_shard = True
    return pallas_gpu_paged


# The seam loads this module for 'gpu' (laminar_jax.kernels.PLUGINS): 'auto' takes the kernel on a GPU
# wherever refuses() lets it, above the portable live_pages.
seam.register_attention(seam.AttentionKernel(NAME, make_decode(), refuses, auto_rank=10, pool_layout=POOL_LAYOUT,
                                             per_shard=True), "gpu")

