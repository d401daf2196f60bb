"""Cache backends plugged into ``Transformer.forward_cached`` (see laminar_jax.model.attention).

Per layer the paged cache is ``(k_pages, v_pages)``: K pool f[P, Hkv, D, page], V pool
f[P, Hkv, page, D] (see "Pool layouts" below; pages leave the engine as f[n, page, Hkv, D]). Decode backends
have the signature

    backend(q, k, v, layer_cache, *, meta: DecodeMeta) -> (out, new_layer_cache)

with q f[B, 1, H, D] and k/v f[B, 1, Hkv, D]. They write the new token's k/v at position
``meta.positions`` of each slot (into the null page 0 for inactive slots) and attend over
positions ``0..meta.positions`` inclusive.

``BACKENDS`` maps a config name (``rollout.attention_impl``) to a decode backend. The default,
``auto`` (resolve_backend), runs ``cpu_kernel`` (one native kernel per layer that reads the live
pages in place: native/paged_attention.cc) on one CPU device, else ``live_pages``, which attends
over a compacted list of only the pages live slots have filled, so its cost follows the live
context (sum over slots), not num_slots x max_total_len or the pool size.
``gather_dense`` gathers every page of each slot's table into a dense f[B, S, Hkv, D] view. An accelerator kernel (e.g. TPU Pallas
``jax.experimental.pallas.ops.tpu.paged_attention``, which wants pages laid out
[Hkv, P, page, D]) plugs in by passing ``Engine(..., attention_backends={name: fn})``, converting
with ``from_pool`` / ``to_pool``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax import native
from laminar_jax.model.attention import NEG_INF, gqa_attention
from laminar_jax.native import ops as native_ops


class LivePages(NamedTuple):
    """The (slot, logical page) pairs live slots attend this step, compacted to a static length N.

    Entries past the live count are padding (``ok`` False, physical page 0). ``inverse[b, j]`` is
    the entry of slot b's j-th page, or N (an always-empty entry) when that page is not live.
    """

    slot: jax.Array  # i32[N]: owner slot of each entry
    index: jax.Array  # i32[N]: logical page index within the owner's table
    page: jax.Array  # i32[N]: physical page id
    ok: jax.Array  # bool[N]: a real entry (not padding)
    inverse: jax.Array  # i32[B, pages_per_seq]
    count: jax.Array  # i32[]: live entries; > N means the bucket was too small (see Engine)


class DecodeMeta(NamedTuple):
    """Per-call metadata closed over by a decode backend."""

    page_table: jax.Array  # i32[B, pages_per_seq]
    positions: jax.Array  # i32[B]: where the new token goes (= tokens already cached)
    active: jax.Array  # bool[B]
    page_size: int
    live: Optional[LivePages] = None  # set by the engine for backends with ``needs_live_pages``
    kv_dtype: Any = jnp.float32  # the values' dtype; pools of 16-bit floats are stored as uint16 (storage_dtype)


def live_page_list(meta: DecodeMeta, num_entries: int) -> LivePages:
    """Compact the pages active slots attend (logical page j of slot b is live iff j * page <= position).

    Order: slot-major, then logical page, so an entry's computation never depends on where the
    compaction put it. ``num_entries`` is static (the engine picks a power-of-two bucket).
    """
    b, n = meta.page_table.shape
    j = jnp.arange(n, dtype=jnp.int32)
    valid = meta.active[:, None] & (j[None, :] * meta.page_size <= meta.positions[:, None])  # bool[B, n]
    flat = jnp.nonzero(valid.reshape(-1), size=num_entries, fill_value=b * n)[0].astype(jnp.int32)  # i32[N]
    ok = flat < b * n
    safe = jnp.minimum(flat, b * n - 1)
    page = jnp.where(ok, meta.page_table.reshape(-1)[safe], 0)
    inverse = jnp.full((b * n + 1,), num_entries, jnp.int32).at[flat].set(jnp.arange(num_entries, dtype=jnp.int32))
    return LivePages(safe // n, safe % n, page, ok, inverse[:-1].reshape(b, n), jnp.sum(valid, dtype=jnp.int32))




def storage_dtype(kv_dtype) -> Any:
    """The dtype the KV pool is stored in: uint16 (the same bits) for 16-bit floats, else kv_dtype.

    Why: XLA:CPU has no bf16/f16 scatter or gather; it widens the whole operand to f32 and back
    around each one, i.e. two copies of the entire KV pool per layer per step (measured: a bf16
    decode step ~4x slower than f32). On uint16 they run in place. Only gathered pages (and the
    tokens written) are bitcast to and from the float dtype, never the pool.
    """
    kv_dtype = jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.uint16) if jnp.issubdtype(kv_dtype, jnp.floating) and kv_dtype.itemsize == 2 else kv_dtype


def as_stored(x: jax.Array, kv_dtype) -> jax.Array:
    """Values in kv_dtype -> their representation in the pool (storage_dtype)."""
    x = x.astype(kv_dtype)
    store = storage_dtype(kv_dtype)
    return jax.lax.bitcast_convert_type(x, store) if store != x.dtype else x


def from_stored(x: jax.Array, kv_dtype) -> jax.Array:
    """Pool representation -> values in kv_dtype."""
    return jax.lax.bitcast_convert_type(x, kv_dtype) if x.dtype != jnp.dtype(kv_dtype) else x


# ---------------------------------------------------------------- pool layouts
# A page of tokens is f[page, Hkv, D] outside the engine (prefill's output, exported sequences).
# In the pools a page is K f[Hkv, D, page] and V f[Hkv, page, D]: decode attention contracts the
# query [Hkv, G, D] with K over D and the probabilities [Hkv, G, page] with V over page, and in these
# layouts both are batched matmuls with the batch axes (entry, KV head) leading and each operand's
# contraction where XLA's dot wants it. With [page, Hkv, D] pages XLA:CPU fused a transpose into
# every page gather: in a 64-row qwen2-100m decode step the 24 K/V gathers took 63 ms of CPU (fp32;
# 39 ms bf16), and 42 ms (27 ms) in these layouts. ([Hkv, page, D] for both, tried before: no gain.)


# Where each axis of a pool's page comes from in the token layout (page, Hkv, D) = (0, 1, 2).
_PAGE_AXES = {True: (1, 2, 0), False: (1, 0, 2)}  # key: K [Hkv, D, page]; value: V [Hkv, page, D]


def pool_shape(num_pages: int, page: int, hkv: int, d: int, *, key: bool) -> tuple[int, ...]:
    dims = (page, hkv, d)
    return (num_pages, *(dims[a] for a in _PAGE_AXES[key]))


def to_pool(x: jax.Array, *, key: bool) -> jax.Array:
    """Pages f[..., page, Hkv, D] -> the pool's layout (K: [..., Hkv, D, page], V: [..., Hkv, page, D])."""
    lead = x.ndim - 3
    return jnp.transpose(x, (*range(lead), *(lead + a for a in _PAGE_AXES[key])))


def from_pool(x: jax.Array, *, key: bool) -> jax.Array:
    """The inverse of to_pool: pool-layout pages -> f[..., page, Hkv, D]."""
    lead = x.ndim - 3
    return jnp.transpose(x, (*range(lead), *(lead + int(a) for a in np.argsort(_PAGE_AXES[key]))))


def gather_pages(pages: jax.Array, idx: jax.Array, kv_dtype) -> jax.Array:
    """pages[idx] (a stored pool [P, ...], idx i32[...]) as kv_dtype values, in the pool's layout."""
    return from_stored(pages[idx], kv_dtype)


def scatter_pages(pages: jax.Array, idx, values: jax.Array, kv_dtype) -> jax.Array:
    """pages.at[idx].set(values): whole pages, values already in the pool's layout."""
    return pages.at[idx].set(as_stored(values, kv_dtype))


def scatter_tokens(pages: jax.Array, page: jax.Array, offset: jax.Array, values: jax.Array, kv_dtype, *,
                   key: bool) -> jax.Array:
    """Write token values f[..., Hkv, D] at (page, offset) (i32[...] each) of a K or V pool."""
    within = [slice(None)] * 3
    within[_PAGE_AXES[key].index(0)] = offset  # the page's token axis
    return pages.at[(page, *within)].set(as_stored(values, kv_dtype))


def write_token(pages: jax.Array, new: jax.Array, meta: DecodeMeta, *, key: bool) -> jax.Array:
    """Write one token per slot into a K or V pool; new f[B, Hkv, D]. Inactive slots hit page 0."""
    b = new.shape[0]
    page = meta.page_table[jnp.arange(b), meta.positions // meta.page_size]
    page = jnp.where(meta.active, page, 0)
    return scatter_tokens(pages, page, meta.positions % meta.page_size, new, meta.kv_dtype, key=key)


def write_kv(layer_cache, k: jax.Array, v: jax.Array, meta: DecodeMeta) -> tuple[jax.Array, jax.Array]:
    """The decode step's token (k, v f[B, 1, Hkv, D]) written into one layer's (K, V) pools."""
    return (write_token(layer_cache[0], k[:, 0], meta, key=True),
            write_token(layer_cache[1], v[:, 0], meta, key=False))


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """One-query GQA softmax attention, the same math as ``gqa_attention`` for T = 1.

    q f[B, 1, H, D]; k, v f[B, S, Hkv, D]; mask bool[B, S] -> f[B, 1, H, D].
    out[b, h] = sum_s softmax_s(q[b, h] . k[b, s, h // G] / sqrt(D)) v[b, s, h // G], in float32.
    Written as broadcast-multiply-reduce instead of a batched einsum: for one query row the
    contractions are tiny matrix-vector products, which XLA:CPU runs ~2x faster fused this way
    (and it reads K/V in their stored [S, Hkv, D] layout, with no transpose).
    """
    b, _, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, 1, hkv, h // hkv, d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d)))
    scores = jnp.sum(k.astype(jnp.float32)[:, :, :, None, :] * qg, axis=-1)  # f32[B, S, Hkv, G]
    scores = jnp.where(mask[:, :, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=1)
    probs = jnp.where(mask.any(-1)[:, None, None, None], probs, 0.0)  # nothing to attend to -> zeros
    out = jnp.sum(probs[..., None] * v.astype(jnp.float32)[:, :, :, None, :], axis=1)  # f32[B, Hkv, G, D]
    return out.reshape(b, 1, h, d).astype(q.dtype)


def _gather(pages: jax.Array, meta: DecodeMeta, *, key: bool) -> jax.Array:
    b, n = meta.page_table.shape
    x = from_pool(gather_pages(pages, meta.page_table, meta.kv_dtype), key=key)  # f[B, n, page, Hkv, D]
    return x.reshape(b, n * x.shape[2], *x.shape[3:])  # f[B, S, Hkv, D]


def _valid(meta: DecodeMeta, s: int) -> jax.Array:
    return (jnp.arange(s)[None, :] <= meta.positions[:, None]) & meta.active[:, None]  # bool[B, S]


def gather_dense(q, k, v, layer_cache, *, meta: DecodeMeta):
    """Portable paged decode attention: write, gather every page of each slot, dense softmax."""
    k_pages, v_pages = write_kv(layer_cache, k, v, meta)
    kg, vg = _gather(k_pages, meta, key=True), _gather(v_pages, meta, key=False)
    return decode_attention(q, kg, vg, _valid(meta, kg.shape[1])), (k_pages, v_pages)


def gather_gqa(q, k, v, layer_cache, *, meta: DecodeMeta):
    """Like gather_dense but through the model's ``gqa_attention`` (the reference; slower on CPU)."""
    k_pages, v_pages = write_kv(layer_cache, k, v, meta)
    kg, vg = _gather(k_pages, meta, key=True), _gather(v_pages, meta, key=False)
    return gqa_attention(q, kg, vg, _valid(meta, kg.shape[1])[:, None, :]), (k_pages, v_pages)


def _page_partials(q, k_pages, v_pages, meta: DecodeMeta):
    """Softmax partials of every physical page against the query of the slot that owns it
    (k_pages f32[P, Hkv, D, page], v_pages f32[P, Hkv, page, D]: the pools' layouts).

    Returns m f32[P, Hkv, G] (max score), l f32[P, Hkv, G] (sum of exp), acc f32[P, Hkv, G, D]
    (exp-weighted sum of values). Pages owned by no active slot, and positions past the owner's
    length, are masked (m = NEG_INF, so they get weight exactly 0 when combined).
    """
    b, _, h, d = q.shape
    p, hkv, _, page = k_pages.shape
    n = meta.page_table.shape[1]
    # owner[p] = the active slot whose page table holds p (pages are never shared); first = its logical index.
    rows = jnp.where(meta.active[:, None], meta.page_table, p)  # out of range -> dropped
    owner = jnp.full((p,), b, jnp.int32).at[rows].set(jnp.broadcast_to(jnp.arange(b)[:, None], (b, n)), mode="drop")
    index = jnp.zeros((p,), jnp.int32).at[rows].set(jnp.broadcast_to(jnp.arange(n)[None, :], (b, n)), mode="drop")
    owned = (owner < b) & (jnp.arange(p) > 0)
    own = jnp.minimum(owner, b - 1)
    qg = q.reshape(b, hkv, h // hkv, d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d)))
    scores = jnp.einsum("pkgd,pkdt->pkgt", qg[own], k_pages.astype(jnp.float32))  # [P, Hkv, G, page]
    pos = index[:, None] * page + jnp.arange(page)[None, :]  # i32[P, page] logical positions
    valid = (owned[:, None] & (pos <= meta.positions[own][:, None]))[:, None, None, :]
    scores = jnp.where(valid, scores, NEG_INF)
    m = jnp.max(scores, axis=-1)
    e = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
    acc = jnp.einsum("pkgt,pktd->pkgd", e, v_pages.astype(jnp.float32))
    return m, jnp.sum(e, axis=-1), acc


def pool_scan(q, k, v, layer_cache, *, meta: DecodeMeta):
    """Paged decode attention that reads each KV page of the pool once, in place (no gather copy).

    Per-page softmax partials (see _page_partials) are gathered back through the page table and
    combined over the fixed pages_per_seq axis in logical order:
        M = max_j m_j,  out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j.
    Unused table entries contribute exact zeros, so a slot's result does not depend on its
    physical pages or on the other slots (moved sequences stay bit-identical). Cost scales with
    the pool size (rollout.num_pages), not num_slots x max_total_len.
    """
    k_pages, v_pages = write_kv(layer_cache, k, v, meta)
    m, l, acc = _page_partials(q, from_stored(k_pages, meta.kv_dtype), from_stored(v_pages, meta.kv_dtype), meta)
    m, l, acc = m[meta.page_table], l[meta.page_table], acc[meta.page_table]  # [B, n, Hkv, G(, D)]
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - top)  # exact 0 for masked entries
    out = jnp.sum(w[..., None] * acc, axis=1) / jnp.maximum(jnp.sum(w * l, axis=1), 1e-30)[..., None]
    b, _, h, d = q.shape
    return out.reshape(b, 1, h, d).astype(q.dtype), (k_pages, v_pages)


def _rows_of(x: jax.Array, idx: jax.Array) -> jax.Array:
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


def live_pages(q, k, v, layer_cache, *, meta: DecodeMeta):
    """Paged decode attention over the compacted live pages (``meta.live``, see live_page_list).

    Per live entry e (slot b, logical page j), against slot b's query, over the page's positions
    p with j * page + p <= position[b]:
        m_e = max_p s_p,  l_e = sum_p exp(s_p - m_e),  acc_e = sum_p exp(s_p - m_e) v_p
    (s_p = q . k_p / sqrt(D)); then per slot over its fixed pages_per_seq table (absent pages are
    the empty entry, m = NEG_INF, weight exactly 0):
        M = max_j m_j,  out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j.
    Every reduction has a fixed length (D, page, pages_per_seq), so a slot's output is bit-identical
    whatever the bucket size N, its physical pages, or the other slots. Cost ~ N x page, where N
    only has to cover the live pages (sum over slots), not num_slots x max_total_len.
    """
    live = meta.live
    if live is None:
        raise ValueError("live_pages attention needs DecodeMeta.live (the engine sets it; see live_page_list)")
    k_pages, v_pages = write_kv(layer_cache, k, v, meta)
    b, _, h, d = q.shape
    _, hkv, _, page = k_pages.shape
    g = h // hkv
    qe = _rows_of(q.reshape(b, h * d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d))),
                  live.slot).reshape(-1, hkv, g, d)  # f32[N, Hkv, G, D]
    ke = gather_pages(k_pages, live.page, meta.kv_dtype).astype(jnp.float32)  # f32[N, Hkv, D, page]
    ve = gather_pages(v_pages, live.page, meta.kv_dtype).astype(jnp.float32)  # f32[N, Hkv, page, D]
    scores = jnp.einsum("nkgd,nkdp->nkgp", qe, ke)  # f32[N, Hkv, G, page]
    pos = live.index[:, None] * page + jnp.arange(page)[None, :]  # i32[N, page]
    valid = (live.ok[:, None] & (pos <= meta.positions[live.slot][:, None]))[:, None, None, :]
    scores = jnp.where(valid, scores, NEG_INF)
    m = jnp.max(scores, axis=-1)  # f32[N, Hkv, G]
    e = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
    l = jnp.sum(e, axis=-1)
    acc = jnp.einsum("nkgp,nkpd->nkgd", e, ve)  # f32[N, Hkv, G, D]
    # Append the empty entry (index N) and gather back per slot in logical page order.
    m = jnp.concatenate([m, jnp.full((1, hkv, g), NEG_INF, m.dtype)])[live.inverse]  # [B, n, Hkv, G]
    l = jnp.concatenate([l, jnp.zeros((1, hkv, g), l.dtype)])[live.inverse]
    acc = jnp.concatenate([acc, jnp.zeros((1, hkv, g, d), acc.dtype)])[live.inverse]  # [B, n, Hkv, G, D]
    w = jnp.exp(m - jnp.max(m, axis=1, keepdims=True))
    out = jnp.sum(w[..., None] * acc, axis=1) / jnp.maximum(jnp.sum(w * l, axis=1), 1e-30)[..., None]
    return out.reshape(b, 1, h, d).astype(q.dtype), (k_pages, v_pages)


live_pages.needs_live_pages = True  # the engine computes meta.live (and its bucket) for this backend


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


cpu_kernel.cpu_only = True  # the engine refuses it off CPU and under a tensor-parallel mesh

DecodeBackend = Callable[..., tuple[jax.Array, tuple[jax.Array, jax.Array]]]

BACKENDS: dict[str, DecodeBackend] = {"live_pages": live_pages, "gather_dense": gather_dense,
                                      "gather_gqa": gather_gqa, "pool_scan": pool_scan, "cpu_kernel": cpu_kernel}
AUTO = "auto"  # rollout.attention_impl's default: see resolve_backend


def cpu_kernel_shape_issue(page_size: int, head_dim: int, group: int) -> Optional[str]:
    """Why the native attention kernel cannot take this geometry, or None (it takes pages and head
    dims in blocks of 16 floats: one AVX-512 vector, two AVX2 ones)."""
    if page_size % 16 or head_dim % 16:
        return f"page_size={page_size} and head_dim={head_dim} must be multiples of 16"
    if not 1 <= group <= 8:
        return f"{group} query heads per KV head (1 to 8 supported)"
    return None


def resolve_backend(name: str, *, platform: str, tensor_parallel: bool, page_size: int, head_dim: int,
                    group: int, field: str = "rollout.attention_impl") -> str:
    """The backend an engine runs for config name ``name`` (group: query heads per KV head).

    'auto': 'cpu_kernel' for an engine on one CPU device whose geometry the native kernel takes and
    whose kernel builds here (the fastest on CPU: docs/BENCHMARKS.md), else 'live_pages' (portable:
    accelerators, tensor parallelism, other geometries, no C++ compiler). An explicit 'cpu_kernel'
    where it cannot run is an error naming the field.
    """
    why = ("off CPU" if platform != "cpu" else "under a tensor-parallel mesh" if tensor_parallel
           else cpu_kernel_shape_issue(page_size, head_dim, group))
    if name == AUTO:
        return "cpu_kernel" if not why and native.available(native_ops.ATTENTION_LIBRARY) is None else "live_pages"
    if getattr(BACKENDS.get(name), "cpu_only", False) and why:
        raise ValueError(f"{field}={name!r} cannot run {why}; use 'live_pages' or 'auto'")
    return name


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
    why = ("off CPU" if platform != "cpu" else "under a tensor-parallel mesh" if tensor_parallel
           else f"for {jnp.dtype(dtype)} weights on this CPU" if not limit
           else native.available(native_ops.PRODUCTS_LIBRARY))
    if why and policy == "native":
        raise ValueError(f"{field}='native' cannot run {why}; use 'auto' or 'xla'")
    return RowKernel(0) if why else RowKernel(limit, floor)


def native_argmax_here(platform: str, tensor_parallel: bool) -> bool:
    """Whether an engine's sampling takes each row's argmax over the vocabulary from the native kernel
    (native_ops.first_argmax): on one CPU device with AVX2 or AVX-512, when it builds here. It picks
    the index that sampling.first_argmax picks, so no setting chooses between them; in XLA:CPU that
    one materialises two arrays of the logits' size (f32[64, 32768]: 1.06 -> 0.23 ms alone;
    [64, 151936]: 28.7 -> 1.1)."""
    return (platform == "cpu" and not tensor_parallel and native_ops.first_argmax_is_faster()
            and native.available(native_ops.ARGMAX_LIBRARY) is None)


def prefill_packed(q, k, v, layer_cache, *, segments: jax.Array, window: int):
    """Prefill of prompts packed end to end in one row (q, k, v f[1, N, ...]): each token attends
    itself and the tokens before it of its own prompt, ``segments`` i32[N] naming every token's prompt.
    ``window``: no prompt is longer (static).

    Returns the new k/v (f[1, N, Hkv, D] each) as the 'cache', as prefill_dense.

    Why in windows: a query's prompt starts at most window - 1 tokens before it, so a chunk of
    ``window`` queries needs only its own and the previous chunk's keys. Attention over the whole
    row cost O(N^2): at N = 256 the call took 35% longer than the same tokens padded in rows of 32
    (qwen2-100m, 2 CPU cores); in chunks it is a batch of [window, 2 * window] products.
    """
    del layer_cache
    n = q.shape[1]
    pos = jnp.arange(n)
    if n <= window or n % window:
        mask = (pos[None, :] <= pos[:, None]) & (segments[None, :] == segments[:, None])
        return gqa_attention(q, k, v, mask[None]), (k, v)
    c = n // window

    def pair(x):  # [1, N, ...] -> [C, 2 * window, ...]: each chunk after the one before it (zeros first)
        x = x.reshape(c, window, *x.shape[2:])
        return jnp.concatenate([jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]]), x], axis=1)

    key_seg = pair(segments[None]).at[0, :window].set(-1)  # chunk 0 has no previous chunk: no segment
    key_pos = pair(pos[None])
    q_seg, q_pos = segments.reshape(c, window), pos.reshape(c, window)
    mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_seg[:, None, :] == q_seg[:, :, None])
    out = gqa_attention(q.reshape(c, window, *q.shape[2:]), pair(k), pair(v), mask)
    return out.reshape(q.shape), (k, v)


def prefill_dense(q, k, v, layer_cache, *, valid_len: jax.Array):
    """Prefill of B padded prompts (B >= 1): row b attends causally over its first ``valid_len[b]`` tokens.

    Returns the new k/v (f[B, T, Hkv, D] each) as the 'cache' so insert can page them in.
    """
    del layer_cache
    t = q.shape[1]
    pos = jnp.arange(t)
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < valid_len[:, None, None])
    return gqa_attention(q, k, v, mask), (k, v)
