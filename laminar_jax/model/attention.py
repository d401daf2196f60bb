"""Attention math, and the seam through which the rollout engine plugs in a KV cache.

Training uses :func:`dense_attention` over padded or packed batches (segment ids).
Decoding calls the model with a *cache backend*: a function

    backend(q, k, v, layer_cache) -> (out, new_layer_cache)

  q: f[B, T, H, D] (RoPE applied), k/v: f[B, T, Hkv, D] for the T new tokens,
  layer_cache: whatever pytree the backend keeps for one layer (e.g. KV pages),
  out: f[B, T, H, D].

The backend writes the new k/v into its cache and attends over everything cached, so the
model never knows whether the cache is contiguous or paged. Per-call metadata (page
tables, lengths) is closed over by the backend (e.g. ``functools.partial``) inside the
caller's jit.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

NEG_INF = -1e30


class CacheBackend(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, layer_cache: Any) -> tuple[jax.Array, Any]:
        ...


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    q: f[B, T, H, D]; k, v: f[B, S, Hkv, D]; mask: bool[B, T, S] (True = may attend).
    Returns f[B, T, H, D]. Scores and softmax run in float32.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(d)))
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    # Rows with nothing to attend to (fully padded) give zeros, not NaN/uniform garbage.
    probs = jnp.where(mask[:, None, None, :, :].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B, T, T]: token i sees token j iff j <= i, same segment, and segment != 0 (padding)."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    valid = (segment_ids != 0)[:, :, None]
    return causal[None] & same & valid


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Training-path attention over a padded/packed batch; see :func:`causal_segment_mask`."""
    return gqa_attention(q, k, v, causal_segment_mask(segment_ids))


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
