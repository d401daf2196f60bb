"""Every layer's KV pages in one pool per K and V, for the model's scan over its layers.

The model runs its layers as one ``lax.scan`` (model/transformer.py, ``scan_layers``), so the
decode state holds ONE K pool and ONE V pool for all layers: layer l owns pages
``l * P .. (l + 1) * P - 1`` (P = rollout.num_pages), and its page 0 (global page l * P) is its null
page. The pools are the scan's carry, so XLA updates them in place in the loop (slicing a layer's
pages out and back would copy them every layer).

The page allocator, page tables and exported sequences speak of one layer's page ids
(0..P-1); the offset is added only here, on the device:
  - ``layered_backend``: each layer's decode attention gets the page table (and the live-page
    list) already offset by l * P, so the decode backends stay layer-agnostic and treat page ids
    as indices into the pool they are given;
  - ``every_layer``: a page-id array for all layers at once (i32[L, ...]), for the page copies
    (prompt KV in, share_prompt, export/import) that touch every layer in one gather or scatter.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.rollout.attention import DecodeMeta


class PoolGeom(NamedTuple):
    """The one K and one V pool of every layer (static): the layout the decode kernels declare
    (rollout/attention.py; the page axis is not always axis 0), the layers, and pages per layer
    (given, never read off a pool's shape)."""

    layout: str
    num_layers: int
    layer_pages: int


def layer_meta(meta: DecodeMeta, offset: jax.Array, layer_pages: int) -> DecodeMeta:
    """``meta`` for the layer whose ``layer_pages`` pages start at global page ``offset`` (i32[], traced)."""
    live = meta.live if meta.live is None else meta.live._replace(page=meta.live.page + offset)
    return meta._replace(page_table=meta.page_table + offset, live=live, first_page=offset, layer_pages=layer_pages)


def layered_backend(attend: Callable, meta: DecodeMeta, layer_pages: int) -> Callable:
    """The model's cache backend ``(q, k, v, pools, layer) -> (out, pools)`` over one-pool-for-all-
    layers ``pools``, from a decode backend ``attend(q, k, v, pools, *, meta)``."""
    def backend(q, k, v, pools, layer):
        return attend(q, k, v, pools, meta=layer_meta(meta, layer * layer_pages, layer_pages))
    return backend


def every_layer(pages: jax.Array, num_layers: int, layer_pages: int) -> jax.Array:
    """i32[L, ...]: one layer's page ids ``pages`` as every layer's global page ids."""
    offsets = jnp.arange(num_layers, dtype=jnp.int32) * layer_pages
    return pages[None].astype(jnp.int32) + offsets.reshape((num_layers,) + (1,) * pages.ndim)


def kv_buffer_backend(prefill: Callable, kv_dtype) -> Callable:
    """A prefill backend (``prefill(q, k, v, None) -> (out, (k, v))``) as the model's cache backend
    over buffers (K f[L, B, T, Hkv, D], V likewise): layer l's new k/v go to index l in place."""
    def backend(q, k, v, buffers, layer):
        out, (k, v) = prefill(q, k, v, None)
        kb, vb = buffers
        return out, (jax.lax.dynamic_update_index_in_dim(kb, k.astype(kv_dtype), layer, 0),
                     jax.lax.dynamic_update_index_in_dim(vb, v.astype(kv_dtype), layer, 0))
    return backend


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_layer(stack: jax.Array, layer: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, layer.astype(stack.dtype), index, 0)


def refill_stacked(old: jax.Array, host, place_layer: Callable,
                   merge_layer: Optional[Callable[[int, jax.Array], jax.Array]] = None) -> jax.Array:
    """A stacked parameter (leading layer axis) refilled in place from its host copy, one layer at a
    time: the old buffer is donated to each layer's update, so the devices hold the stack plus one
    layer of it during a weight swap, not two stacks. ``place_layer(host_layer)`` puts one layer on
    the devices in the stack's layout minus its first axis; ``merge_layer(i, layer)``, if given,
    turns the placed layer into what is stored (a LoRA merge, rollout/lora_merge.py)."""
    out = old
    for i in range(old.shape[0]):
        layer = place_layer(np.asarray(host[i]))
        out = _set_layer(out, layer if merge_layer is None else merge_layer(i, layer), np.int32(i))
    return out
