"""The CPU plugin's kernels, registered with the kernel seam (rollout/kernels.py) on import.

The seam imports this module (through ``laminar_jax.kernels.PLUGINS``) when an engine asks for the
``cpu`` platform's kernels; it registers:

- ``cpu_kernel``: live_pages' contract through one native kernel per layer that reads the live
  pages in place (native/paged_attention.cc); 'auto' takes it on one CPU device for the geometries
  it takes, when it builds here;
- the CPU form of ``live_pages``, whose live entries' query rows are a one-hot product
  (``rows_of_onehot``) instead of a gather;
- the engine's weight products of few rows on native/row_products.cc (``rollout.weight_products``),
  low-precision products coming out in float32 as XLA:CPU's bf16 kernels produce them;
- sampling's argmax on native/argmax.cc.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from laminar_jax.cpu import native
from laminar_jax.cpu.native import ops as native_ops
from laminar_jax.model.products import Products
from laminar_jax.rollout import kernels as seam
from laminar_jax.rollout.attention import DecodeMeta, live_pages, write_kv
from laminar_jax.rollout.sampling import first_argmax

PLATFORM = "cpu"


def rows_of_onehot(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] (x f32[B, F], idx i32[N] in [0, B)) as a one-hot matmul, bit-exact for finite x.

    Why not a gather: XLA:CPU fuses x's elementwise producers (here RoPE, with its sin/cos) into
    the gather and recomputes them for every one of the N x F outputs, which cost more than the
    rest of the attention. A dot materialises x once. Each output is 1 * x[idx] plus exact
    zeros, so it equals the gather bit for bit whatever N or the kernel; a non-finite row (which
    0 * x would spread to every entry) is zeroed for the product and flagged back as NaN on its
    own entries only.
    """
    finite = jnp.isfinite(x)
    onehot = (idx[:, None] == jnp.arange(x.shape[0])[None, :]).astype(x.dtype)  # f32[N, B]
    out = jnp.dot(onehot, jnp.where(finite, x, 0.0), precision=jax.lax.Precision.HIGHEST)
    bad = ~jnp.all(finite, axis=-1)  # bool[B]
    return jnp.where(bad[idx][:, None], jnp.nan, out)


live_pages_cpu = functools.partial(live_pages, rows_of=rows_of_onehot)
live_pages_cpu.needs_live_pages = True


def cpu_kernel_shape_issue(page_size: int, head_dim: int, group: int) -> Optional[str]:
    """Why the native attention kernel cannot take this geometry, or None (it takes pages and head
    dims in blocks of 16 floats: one AVX-512 vector, two AVX2 ones)."""
    if page_size % 16 or head_dim % 16:
        return f"page_size={page_size} and head_dim={head_dim} must be multiples of 16"
    if not 1 <= group <= 8:
        return f"{group} query heads per KV head (1 to 8 supported)"
    return None


def cpu_kernel(q, k, v, layer_cache, *, meta: DecodeMeta):
    """live_pages' contract through one native CPU kernel per layer (native/paged_attention.cc).

    Writes the token, then each active row attends over its first position + 1 tokens, reading its
    pages in place; inactive rows get zeros. Float32 or bfloat16 KV; page size and head dim multiples
    of 16, 1 to 8 query heads per KV head (cpu_kernel_shape_issue). Equal to live_pages to float rounding. A row's output
    depends on nothing but that row, so moved sequences stay output-identical.
    """
    b, _, h, d = q.shape
    why = ("KV of dtype " + str(meta.kv_dtype) if jnp.dtype(meta.kv_dtype) not in native_ops.KV_DTYPES
           else cpu_kernel_shape_issue(meta.page_size, d, h // k.shape[2]))
    if why:
        raise ValueError(f"rollout.attention_impl='cpu_kernel' cannot run {why}")
    k_pages, v_pages = write_kv(layer_cache, k, v, meta)
    qs = q.reshape(b, h, d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d)))
    length = jnp.where(meta.active, meta.positions + 1, 0)
    out = native_ops.paged_attention(qs, k_pages, v_pages, meta.page_table, length)
    return out.reshape(b, 1, h, d).astype(q.dtype), (k_pages, v_pages)


def _cpu_kernel_refuses(g: seam.Geometry) -> Optional[str]:
    if g.tensor_parallel > 1:
        return "under a tensor-parallel mesh"
    if jnp.dtype(g.dtype) not in native_ops.KV_DTYPES:
        return f"KV of dtype {jnp.dtype(g.dtype)}"
    why = cpu_kernel_shape_issue(g.page_size, g.head_dim, g.group)
    return why or native.available(native_ops.ATTENTION_LIBRARY)  # the build last: it compiles on first use


class RowKernel(NamedTuple):
    """Which decode weight products run the native kernel: those of at most ``rows`` rows whose
    weights have at least ``min_weights`` elements (rows 0: none, every product on XLA's dot)."""

    rows: int
    min_weights: int = 0


def resolve_row_kernel(policy: str, dtype, *, platform: str, tensor_parallel: bool, largest_weight: int,
                       field: str = "rollout.weight_products") -> RowKernel:
    """Which of an engine's decode weight products run the native kernel, for a model whose largest
    weight has ``largest_weight`` elements (`TransformerConfig.largest_weight()`).

    'auto': on one CPU device, for the weight dtypes native_ops.row_products_max_rows names (on CPUs
    with AVX-512: float32, and bfloat16 with AVX-512 BF16; on AVX2: both), when the kernel builds
    here, up to that many rows (where it was measured faster than XLA:CPU's dot), and only for
    weights of at least native_ops.row_products_min_weights elements (on AVX2 the kernel's call costs
    more than it saves on smaller ones). A model with no weight that large gets none, and the
    kernel is not even built (a first run would compile it for nothing). 'xla': never.
    'native': on one CPU device for float32 or bfloat16 weights, every weight, also where 'auto'
    would not (up to row_products_insisted_rows rows), and an error naming the field where it
    cannot run.
    """
    if policy == "xla":
        return RowKernel(0)
    floor = native_ops.row_products_min_weights(dtype) if policy == "auto" else 0
    if largest_weight < floor:
        return RowKernel(0)  # before the build check below: that check builds the kernel
    # Per dtype and CPU: where it beat XLA's dot; or, insisted on, wherever it is correct.
    limit = (native_ops.row_products_max_rows if policy == "auto" else native_ops.row_products_insisted_rows)(dtype)
    why = ("off CPU" if platform != PLATFORM else "under a tensor-parallel mesh" if tensor_parallel
           else f"for {jnp.dtype(dtype)} weights on this CPU" if not limit
           else native.available(native_ops.PRODUCTS_LIBRARY))
    if why and policy == "native":
        raise ValueError(f"{field}='native' cannot run {why}; use 'auto' or 'xla'")
    return RowKernel(0) if why else RowKernel(limit, floor)


def products_for(policy: str, g: seam.Geometry, largest_weight: int, field: str) -> tuple[Products, str]:
    """The seam's products chooser for the CPU: XLA's dot with float32 output for low precision
    (XLA:CPU's bf16 kernels accumulate in and produce float32), plus the row kernel where
    resolve_row_kernel puts it."""
    rows, floor = resolve_row_kernel(policy, g.dtype, platform=PLATFORM, tensor_parallel=g.tensor_parallel > 1,
                                     largest_weight=largest_weight, field=field)
    if not rows:
        return Products(jnp.float32), ""
    return Products(jnp.float32, native_ops.row_products, rows, floor), ""


def native_argmax_here(platform: str, tensor_parallel: bool) -> bool:
    """Whether an engine's sampling takes each row's argmax over the vocabulary from the native kernel
    (native_ops.first_argmax): on one CPU device with AVX2 or AVX-512, when it builds here. It picks
    the index that sampling.first_argmax picks, so no setting chooses between them; in XLA:CPU that
    one materialises two arrays of the logits' size, a cost that grows with the vocabulary; the
    kernel reads each row once."""
    return (platform == PLATFORM and not tensor_parallel and native_ops.first_argmax_is_faster()
            and native.available(native_ops.ARGMAX_LIBRARY) is None)


def argmax_for(g: seam.Geometry) -> Optional[tuple[Callable, str]]:
    """The native kernel where it serves, else sampling.first_argmax (XLA:CPU's jnp.argmax is a variadic
    reduction that does not vectorise; the seam's default off the CPU is jnp.argmax)."""
    if native_argmax_here(PLATFORM, g.tensor_parallel > 1):
        return native_ops.first_argmax, "native"
    return first_argmax, "xla"


seam.register_attention(seam.AttentionKernel("cpu_kernel", cpu_kernel, _cpu_kernel_refuses, auto_rank=10),
                        PLATFORM)
seam.register_attention(seam.AttentionKernel("live_pages", live_pages_cpu, auto_rank=1, needs_live_pages=True),
                        PLATFORM)
seam.register_products(PLATFORM, products_for)
seam.register_argmax(PLATFORM, argmax_for)
