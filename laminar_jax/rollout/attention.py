"""Cache backends plugged into ``Transformer.forward_cached`` (see laminar_jax.model.attention).

Per layer the paged cache is ``(k_pages, v_pages)`` in the layout the decode attention declares:
K pool f[P, Hkv, D, page], V pool f[P, Hkv, page, D] for the portable backends here ('split'), K and
V f[Hkv, P, page, D] for the Pallas kernels ('head_major'); see "pool layouts" below (pages leave the
engine as f[n, page, Hkv, D] whatever the layout). Decode backends have the signature

    backend(q, k, v, layer_cache, *, meta: DecodeMeta) -> (out, new_layer_cache)

with q f[B, 1, H, D] and k/v f[B, 1, Hkv, D]. They write the new token's k/v at position
``meta.positions`` of each slot (into the null page 0 for inactive slots) and attend over
positions ``0..meta.positions`` inclusive.

Which backend an engine runs is the kernel seam's choice (rollout/kernels.py): the portable
backends here serve every platform; ``live_pages`` (the default off the CPU plugin's native kernel)
attends over a compacted list of only the pages live slots have filled, so its cost follows the
live context (sum over slots), not num_slots x max_total_len or the pool size. ``gather_dense``
gathers every page of each slot's table into a dense f[B, S, Hkv, D] view; ``pool_scan`` reads
every page of the pool once. Platform kernels (laminar_jax/cpu/kernels.py, the Pallas kernels of
rollout/kernels_gpu.py and kernels_tpu.py) register with the seam, naming the pool layout they read.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.model.attention import NEG_INF, gqa_attention


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
    # One pool of every layer's pages (rollout/layered.py): this layer's pages are first_page ..
    # first_page + layer_pages - 1 (first_page i32[], its null page); layer_pages 0: the pool is one layer's.
    first_page: Any = 0
    layer_pages: int = 0


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




def storage_dtype(kv_dtype, layout: str = "split") -> Any:
    """The dtype a KV pool of ``layout`` is stored in: in the CPU layout ('split') uint16 (the same
    bits) for 16-bit floats, else kv_dtype.

    Why: XLA:CPU has no bf16/f16 scatter or gather; it widens the whole operand to f32 and back
    around each one, i.e. two copies of the entire KV pool per layer per step. On uint16 they run in place. Only gathered pages (and the
    tokens written) are bitcast to and from the float dtype, never the pool. Accelerator layouts
    keep the float dtype: their kernels read it as is, and a bitcast would sit between them and it.
    """
    kv_dtype = jnp.dtype(kv_dtype)
    if layout == POOL_LAYOUT and jnp.issubdtype(kv_dtype, jnp.floating) and kv_dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return kv_dtype


def as_stored(x: jax.Array, kv_dtype, layout: str = "split") -> jax.Array:
    """Values in kv_dtype -> their representation in a pool of ``layout`` (storage_dtype)."""
    x = x.astype(kv_dtype)
    store = storage_dtype(kv_dtype, layout)
    return jax.lax.bitcast_convert_type(x, store) if store != x.dtype else x


def from_stored(x: jax.Array, kv_dtype) -> jax.Array:
    """Pool representation -> values in kv_dtype."""
    return jax.lax.bitcast_convert_type(x, kv_dtype) if x.dtype != jnp.dtype(kv_dtype) else x


# ---------------------------------------------------------------- pool layouts
# A page of tokens is f[page, Hkv, D] outside the engine (prefill's output, exported sequences).
# The engine allocates its pools in the layout its decode attention declares
# (``DecodeKernels.pool_layout``); every function below that touches a pool takes that layout.
#
# 'split' (the portable kernels and the CPU's): a page is K f[Hkv, D, page] and V f[Hkv, page, D]:
# decode attention contracts the query [Hkv, G, D] with K over D and the probabilities
# [Hkv, G, page] with V over page, and in these layouts both are batched matmuls with the batch axes
# (entry, KV head) leading and each operand's contraction where XLA's dot wants it. With
# [page, Hkv, D] pages XLA:CPU fuses a transpose into every page gather. ([Hkv, page, D] for both
# pools gains nothing over this split.)
# 'head_major' (the Pallas kernels, rollout/head_major.py): K and V f[Hkv, P, page, D].
#
# Page ids are global indices into the pool a function is given: a pool may hold more pages than
# one layer's rollout.num_pages (several layers' pages in one array), and nothing here assumes
# where a layer's pages start.

POOL_LAYOUT = "split"  # the portable kernels' layout (K [P, Hkv, D, page], V [P, Hkv, page, D])
HEAD_MAJOR = "head_major"  # K and V [Hkv, P, page, D]

# Per layout, where each axis of a (K, V) pool comes from in the token layout
# (pages, page, Hkv, D) = (0, 1, 2, 3).
_LAYOUTS = {POOL_LAYOUT: ((0, 2, 3, 1), (0, 2, 1, 3)), HEAD_MAJOR: ((2, 0, 1, 3), (2, 0, 1, 3))}
POOL_LAYOUTS = tuple(_LAYOUTS)


def _axes(layout: str, key: bool) -> tuple[int, ...]:
    if layout not in _LAYOUTS:
        raise ValueError(f"KV pool layout {layout!r}: one of {list(_LAYOUTS)}")
    return _LAYOUTS[layout][0 if key else 1]


def pool_shape(num_pages: int, page: int, hkv: int, d: int, *, key: bool, layout: str = POOL_LAYOUT
               ) -> tuple[int, ...]:
    """The shape of a K (``key``) or V pool of ``num_pages`` pages in ``layout``: the one source of it."""
    dims = (num_pages, page, hkv, d)
    return tuple(dims[a] for a in _axes(layout, key))


def page_axis(layout: str, *, key: bool) -> int:
    """The pool's page axis (the one page ids index)."""
    return _axes(layout, key).index(0)


def head_axis(layout: str) -> int:
    """The pools' KV-head axis (tensor parallelism splits it; the same for K and V)."""
    return _axes(layout, True).index(2)


def to_pool(x: jax.Array, *, key: bool, layout: str = POOL_LAYOUT) -> jax.Array:
    """Pages f[..., n, page, Hkv, D] -> the pool's layout (the n pages where the pool has its page axis)."""
    lead = x.ndim - 4
    return jnp.transpose(x, (*range(lead), *(lead + a for a in _axes(layout, key))))


def from_pool(x: jax.Array, *, key: bool, layout: str = POOL_LAYOUT) -> jax.Array:
    """The inverse of to_pool: n pages in the pool's layout -> f[..., n, page, Hkv, D]."""
    lead = x.ndim - 4
    return jnp.transpose(x, (*range(lead), *(lead + int(a) for a in np.argsort(_axes(layout, key)))))


def take_pages(pages: jax.Array, idx: jax.Array, *, key: bool, layout: str = POOL_LAYOUT) -> jax.Array:
    """The pool's pages ``idx`` (i32[n]), still stored, in the pool's layout with n pages."""
    return jnp.take(pages, idx, axis=page_axis(layout, key=key), mode="clip")


def gather_pages(pages: jax.Array, idx: jax.Array, kv_dtype) -> jax.Array:
    """pages[idx] (a stored 'split' pool [P, ...], idx i32[...]) as kv_dtype values, in the pool's layout."""
    return from_stored(pages[idx], kv_dtype)


def scatter_pages(pages: jax.Array, idx, values: jax.Array, kv_dtype, *, key: bool = True,
                  layout: str = POOL_LAYOUT) -> jax.Array:
    """Whole pages ``idx`` (i32[n]) of the pool set to ``values`` (n pages already in the pool's layout)."""
    at = (slice(None),) * page_axis(layout, key=key) + (idx,)
    return pages.at[at].set(as_stored(values, kv_dtype, layout))


def copy_pages(pages: jax.Array, src, dst, *, key: bool, layout: str = POOL_LAYOUT) -> jax.Array:
    """Pages ``src`` copied onto pages ``dst`` (i32[n] each), bits as stored."""
    at = (slice(None),) * page_axis(layout, key=key) + (dst,)
    return pages.at[at].set(take_pages(pages, src, key=key, layout=layout))


def scatter_tokens(pages: jax.Array, page: jax.Array, offset: jax.Array, values: jax.Array, kv_dtype, *,
                   key: bool, layout: str = POOL_LAYOUT) -> jax.Array:
    """Write token values f[..., Hkv, D] at (page, offset) (i32[...] each) of a K or V pool."""
    axes = _axes(layout, key)
    pa, ta, ha = axes.index(0), axes.index(1), axes.index(2)
    page, offset = jnp.broadcast_arrays(page, offset)
    at = [slice(None)] * 4
    at[pa], at[ta] = page, offset
    vals = as_stored(values, kv_dtype, layout)
    if ha < min(pa, ta):
        # Heads before the page axes (head-major pools): index the heads as well, so the scatter's
        # window is D alone. With a window over (Hkv, D) XLA:TPU lays a loop-carried pool out
        # page-major for the scatter and copies the whole pool back to the layout the attention
        # kernel reads, every layer of every step.
        at[ha], at[pa], at[ta] = jnp.arange(pages.shape[ha]), page[..., None], offset[..., None]
        return pages.at[tuple(at)].set(vals)
    if axes.index(3) < axes.index(2):  # the pool holds D before Hkv
        vals = jnp.swapaxes(vals, -1, -2)
    if abs(pa - ta) == 1:  # adjacent index arrays: their dims stand where the pair stands, not first
        nb, before = page.ndim, min(pa, ta)
        vals = jnp.moveaxis(vals, tuple(range(nb, nb + before)), tuple(range(before)))
    return pages.at[tuple(at)].set(vals)


def write_token(pages: jax.Array, new: jax.Array, meta: DecodeMeta, *, key: bool,
                layout: str = POOL_LAYOUT) -> jax.Array:
    """Write one token per slot into a K or V pool; new f[B, Hkv, D]. Inactive slots hit page 0."""
    b = new.shape[0]
    page = meta.page_table[jnp.arange(b), meta.positions // meta.page_size]
    page = jnp.where(meta.active, page, meta.first_page)
    return scatter_tokens(pages, page, meta.positions % meta.page_size, new, meta.kv_dtype, key=key, layout=layout)


def write_kv(layer_cache, k: jax.Array, v: jax.Array, meta: DecodeMeta,
             layout: str = POOL_LAYOUT) -> tuple[jax.Array, jax.Array]:
    """The decode step's token (k, v f[B, 1, Hkv, D]) written into one layer's (K, V) pools."""
    return (write_token(layer_cache[0], k[:, 0], meta, key=True, layout=layout),
            write_token(layer_cache[1], v[:, 0], meta, key=False, layout=layout))


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
    kp, vp = k_pages, v_pages
    if meta.layer_pages:  # one pool of every layer: read this layer's pages only (the others are not its own)
        kp, vp = (jax.lax.dynamic_slice_in_dim(x, meta.first_page, meta.layer_pages, axis=0) for x in (kp, vp))
        meta = meta._replace(page_table=meta.page_table - meta.first_page, first_page=0)
    m, l, acc = _page_partials(q, from_stored(kp, meta.kv_dtype), from_stored(vp, meta.kv_dtype), meta)
    m, l, acc = m[meta.page_table], l[meta.page_table], acc[meta.page_table]  # [B, n, Hkv, G(, D)]
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - top)  # exact 0 for masked entries
    out = jnp.sum(w[..., None] * acc, axis=1) / jnp.maximum(jnp.sum(w * l, axis=1), 1e-30)[..., None]
    b, _, h, d = q.shape
    return out.reshape(b, 1, h, d).astype(q.dtype), (k_pages, v_pages)


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx]: each live entry's query row (x f32[B, F], idx i32[N]). A platform may register its
    own form with live_pages (the CPU plugin's avoids an XLA:CPU fusion that recomputes RoPE)."""
    return x[idx]


def live_pages(q, k, v, layer_cache, *, meta: DecodeMeta, rows_of: Callable = take_rows):
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
    ``rows_of(x, idx)`` = x[idx] bit for bit (take_rows, or a platform's form of it).
    """
    live = meta.live
    if live is None:
        raise ValueError("live_pages attention needs DecodeMeta.live (the engine sets it; see live_page_list)")
    k_pages, v_pages = write_kv(layer_cache, k, v, meta)
    b, _, h, d = q.shape
    _, hkv, _, page = k_pages.shape
    g = h // hkv
    qe = rows_of(q.reshape(b, h * d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d))),
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


DecodeBackend = Callable[..., tuple[jax.Array, tuple[jax.Array, jax.Array]]]


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
