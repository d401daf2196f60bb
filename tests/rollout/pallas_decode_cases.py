"""Random paged decode cases for the Pallas decode kernels, and the portable reference they must match.

A case is one layer's state: pages f[P, page, Hkv, D] in the token layout, a page table whose
unused entries point at the null page 0, ragged positions (first token, a page's last slot, a page's
first slot, deep into the table) and an inactive row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.rollout import attention, head_major


def make_case(*, rows=4, heads=4, kv_heads=2, head_dim=32, page=8, pages_per_seq=4, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    num_pages = rows * pages_per_seq + 1
    positions = np.array([0, page - 1, page, pages_per_seq * page - 2, 3, page + 1][:rows], np.int32)
    active = np.ones(rows, bool)
    active[-1] = False  # an inactive row: writes into page 0, gives zeros
    table = np.zeros((rows, pages_per_seq), np.int32)
    free = list(r.permutation(np.arange(1, num_pages)))
    for b in range(rows):
        for j in range(positions[b] // page + 1):
            table[b, j] = free.pop()
    tokens = r.normal(size=(2, num_pages, page, kv_heads, head_dim)).astype(np.float32)
    q = r.normal(size=(rows, 1, heads, head_dim)).astype(np.float32)
    k = r.normal(size=(rows, 1, kv_heads, head_dim)).astype(np.float32)
    v = r.normal(size=(rows, 1, kv_heads, head_dim)).astype(np.float32)
    meta = attention.DecodeMeta(page_table=jnp.asarray(table), positions=jnp.asarray(positions),
                                active=jnp.asarray(active), page_size=page, kv_dtype=dtype)
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), tokens=cast(tokens), meta=meta)


def reference(case):
    """gather_dense over the engine's CPU pools: (out f32[B, 1, H, D], K and V token pages)."""
    meta, tok = case["meta"], case["tokens"]
    cache = tuple(attention.as_stored(attention.to_pool(tok[i], key=i == 0), meta.kv_dtype) for i in (0, 1))
    out, (kp, vp) = attention.gather_dense(case["q"], case["k"], case["v"], cache, meta=meta)
    pages = [attention.from_pool(attention.from_stored(p, meta.kv_dtype), key=i == 0) for i, p in enumerate((kp, vp))]
    return np.asarray(out, np.float32), [np.asarray(p, np.float32) for p in pages]


def run_head_major(backend, case):
    """A head-major kernel on the same state: (out, K and V token pages)."""
    meta, tok = case["meta"], case["tokens"]
    cache = tuple(attention.as_stored(head_major.to_pool(tok[i]), meta.kv_dtype, head_major.POOL_LAYOUT) for i in (0, 1))
    out, pools = jax.jit(lambda q, k, v, c: backend(q, k, v, c, meta=meta))(case["q"], case["k"], case["v"], cache)
    pages = [np.asarray(head_major.from_pool(attention.from_stored(p, meta.kv_dtype)), np.float32) for p in pools]
    return np.asarray(out, np.float32), pages


def tolerance(dtype) -> float:
    # bf16: the kernels take the query in the KV dtype (one rounding of q), the reference keeps f32.
    return 3e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 2e-5


def check(backend, case, tol_dtype=None):
    want, want_pages = reference(case)
    got, got_pages = run_head_major(backend, case)
    tol = tolerance(tol_dtype or case["meta"].kv_dtype)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert np.all(got[~np.asarray(case["meta"].active)] == 0), "an inactive row must give zeros"
    for g, w in zip(got_pages, want_pages):
        np.testing.assert_array_equal(g, w)  # the token lands where the portable path puts it
