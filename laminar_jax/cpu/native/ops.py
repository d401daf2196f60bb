"""The native CPU kernels as JAX operations (``jax.ffi`` calls; each builds its library on first use).

``paged_attention``: decode attention over a paged KV cache, read in place (paged_attention.cc;
the ``cpu_kernel`` decode backend, rollout/attention.py). ``row_products``: y = x . W^T for a few
rows x against a weight stored [out, in] (row_products.cc; the rollout engine's decode steps,
model/transformer.py's ``Linear``). ``first_argmax``: each row's first index of its maximum
(argmax.cc; the engine's sampling). This module imports nothing of the model or rollout packages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from laminar_jax.cpu import native

ATTENTION_LIBRARY, ATTENTION_TARGET = "paged_attention", "laminar_paged_attention"
PRODUCTS_LIBRARY, PRODUCTS_TARGET = "row_products", "laminar_row_products"
ARGMAX_LIBRARY, ARGMAX_TARGET = "argmax", "laminar_first_argmax"
KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# The most rows for which the engine's decode weight products run row_products, per weight dtype.
# With AVX-512 the kernel's GEMM path from 4 rows beats XLA:CPU's dot up to 64 rows (which packs the
# weight operand on every call), and at 128 rows they are even; with AVX-512 BF16 a 1-row bf16
# product avoids XLA's slow 1-row bf16 path. On AVX2 the kernel's 8-float form wins at 2-16 rows
# and its 8-float GEMM path from 32 float32 rows, up to 64; bf16 above 16 rows stays on XLA's dot.
# The tiny demo model's products (at most 192 x 64 weights) are too short for the FFI call's
# overhead, so on AVX2 the kernel takes weights of at least MIN_WEIGHTS_AVX2 elements. 16-float
# vectors on AVX2 take two registers each and spill, hence 8-float ones there.
MAX_ROWS_AVX512 = {jnp.dtype(jnp.float32): 64, jnp.dtype(jnp.bfloat16): 64}
MAX_ROWS_AVX2 = {jnp.dtype(jnp.float32): 64, jnp.dtype(jnp.bfloat16): 16}
MIN_WEIGHTS_AVX2 = 1 << 16


@functools.lru_cache(maxsize=None)  # read /proc/cpuinfo once per process, not per engine built
def cpu_flags() -> frozenset:
    """This CPU's feature flags (the kernels are compiled for them with -march=native); empty off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def _kernel_form(dtype) -> str:
    """Which of the kernel's builds beats XLA's dot here for ``dtype`` weights: 'avx512' (its GEMM and
    vdpbf16ps paths), 'avx2' (its 8-float vectors), or '' (none: a CPU with AVX-512 but not its BF16
    instructions compiles the 16-float bfloat16 path, slower than XLA's)."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512" if jnp.dtype(dtype) != jnp.bfloat16 or "avx512_bf16" in flags else ""
    return "avx2" if {"avx2", "fma"} <= flags else ""


def row_products_gemm_rows(dtype) -> int:
    """From how many rows row_products runs its GEMM path for ``dtype`` weights on this CPU (0: never).
    A row's result depends on its row count's path (the order of its sums), never on the other rows;
    these mirror row_products.cc's kPackMinRows* (AVX-512: float32 from 4, where 4-16 rows with K in
    4s take the 4-rows-by-4-k form instead; bfloat16 from 8 with AVX-512 BF16; AVX2: float32 from 32)."""
    f32 = jnp.dtype(dtype) == jnp.float32
    return {"avx512": 4 if f32 else 8, "avx2": 32 if f32 else 0}.get(_kernel_form(dtype), 0)


def row_products_max_rows(dtype) -> int:
    """The most rows of a product of ``dtype`` weights that the engine runs on row_products (0: none)."""
    limits = {"avx512": MAX_ROWS_AVX512, "avx2": MAX_ROWS_AVX2}.get(_kernel_form(dtype), {})
    return limits.get(jnp.dtype(dtype), 0)


def row_products_min_weights(dtype) -> int:
    """The fewest weight elements of a product that the engine runs on row_products under 'auto'
    (smaller products stay on XLA's dot, where the kernel's call costs more than it saves)."""
    return MIN_WEIGHTS_AVX2 if _kernel_form(dtype) == "avx2" else 0


def row_products_insisted_rows(dtype) -> int:
    """The most rows run on row_products when the user insists (rollout.weight_products='native'):
    the measured limit, or 16 where the kernel is correct but not faster (0: a dtype it cannot take)."""
    if jnp.dtype(dtype) not in WEIGHT_DTYPES:
        return 0
    return max(row_products_max_rows(dtype), 16)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    length: jax.Array) -> jax.Array:
    """q f32[B, H, D] (scaled by 1/sqrt(D)), K pool [P, Hkv, D, page] and V pool [P, Hkv, page, D]
    (float32, or uint16 holding bfloat16), page_table i32[B, n], length i32[B] (0: inactive row)
    -> f32[B, H, D]: each row's softmax attention over its first ``length`` tokens."""
    native.load(ATTENTION_LIBRARY)  # builds and registers the target on first use (raises NativeUnavailable)
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_pages, v_pages, page_table.astype(jnp.int32), length.astype(jnp.int32))


def row_products(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[M, K] . w[N, K]^T -> f32[M, N], w float32 or bfloat16 (products and sums in float32)."""
    if jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"row_products: weights of dtype {w.dtype}; float32 or bfloat16 only")
    native.load(PRODUCTS_LIBRARY)
    return jax.ffi.ffi_call(PRODUCTS_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))(
        x.astype(jnp.float32), w)


def first_argmax_is_faster() -> bool:
    """Whether first_argmax beats XLA's form on this CPU: with AVX2 or AVX-512 it reads each row once
    in vectors, where XLA's form writes two arrays of the logits' size. Built for baseline x86-64
    (SSE2, no vector blend) its selects go scalar and it loses."""
    return bool({"avx2", "avx512f"} & cpu_flags())


def first_argmax(x: jax.Array) -> jax.Array:
    """x f32[B, V] -> i32[B]: each row's first index of its maximum (a NaN counts as the maximum), the
    same index rollout.sampling.first_argmax picks (argmax.cc)."""
    native.load(ARGMAX_LIBRARY)
    return jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))(x.astype(jnp.float32))


__all__ = ["paged_attention", "row_products", "first_argmax", "first_argmax_is_faster", "row_products_max_rows",
           "row_products_gemm_rows",
           "row_products_min_weights", "row_products_insisted_rows", "KV_DTYPES", "WEIGHT_DTYPES"]
