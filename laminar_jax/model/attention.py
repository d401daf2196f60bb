"""Attention math, and the seam through which the rollout engine plugs in a KV cache.

Training uses :func:`dense_attention` over padded or packed batches (segment ids), or for long
rows :func:`chunked_attention` (portable, O(chunk x T) memory), ``flash.flash_attention`` (portable
blockwise attention with a custom backward, skipping masked key blocks) or
:func:`pallas_gpu_attention` (JAX's Pallas GPU kernel), or a kernel library's (``train_kernels``: tokamax
on GPU, splash on TPU); :func:`train_attention` maps ``learner.attention_impl`` to one of them.
Decoding calls the model with a *cache backend*: a function

    backend(q, k, v, cache, layer) -> (out, new_cache)

  q: f[B, T, H, D] (RoPE applied), k/v: f[B, T, Hkv, D] for the T new tokens,
  cache: whatever pytree the backend keeps for all layers (e.g. one KV pool of every layer's
  pages), carried through the layers' scan; layer: i32[] the layer's index (traced),
  out: f[B, T, H, D].

The backend writes the new k/v into its cache and attends over everything cached, so the
model never knows whether the cache is contiguous or paged. Per-call metadata (page
tables, lengths) is closed over by the backend (e.g. ``functools.partial``) inside the
caller's jit.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

NEG_INF = -1e30


class CacheBackend(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, layer: jax.Array) -> tuple[jax.Array, Any]:
        ...


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    q: f[B, T, H, D]; k, v: f[B, S, Hkv, D]; mask: bool[B, T, S] (True = may attend).
    Returns f[B, T, H, D]. Scores and softmax run in float32.
    """
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    # Heads first, a KV head's G query heads stacked along the rows: both products are then plain
    # batched matmuls [B*Hkv] x [G*T, D] x [D, S] in the layout their outputs keep. Transposing
    # q/k/v (O(T*D)) instead of the scores (O(T*S)) cut a training step's attention (forward and
    # backward) by ~40% on XLA:CPU, whose backward otherwise transposed every score-sized tensor.
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, S, D]
    scores = jnp.einsum("bkqd,bksd->bkqs", qg.astype(jnp.float32), kt.astype(jnp.float32))
    scores = scores.reshape(b, hkv, g, t, s) * (1.0 / jnp.sqrt(jnp.float32(d)))
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    # Rows with nothing to attend to (fully padded) give zeros, not NaN/uniform garbage.
    probs = jnp.where(mask[:, None, None, :, :].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(b, hkv, g * t, s), vt.astype(jnp.float32))
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


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


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                      chunk: int = 1024) -> jax.Array:
    """:func:`dense_attention` computed ``chunk`` query rows at a time, each chunk rematerialised.

    Why: dense attention holds f32[B, H, T, T] scores (and autodiff keeps them for the backward
    pass), 30 GB per layer for one 16K-token row of a 7B model. Here at most f32[B, H, chunk, T]
    exists at once, forward or backward: the chunks run in a ``lax.map`` under ``jax.checkpoint``,
    so the backward pass keeps only q/k/v and recomputes one chunk's scores at a time. Each query
    row sees the same keys under the same mask as in dense_attention (the same softmax), so
    values and gradients agree to float rounding. Cost: the masked future keys of a chunk are
    still computed (up to 2x attention FLOPs at long T); 'flash' and 'pallas_gpu' skip them.
    """
    b, t, h, d = q.shape
    if chunk <= 0 or t <= chunk:
        return dense_attention(q, k, v, segment_ids)
    n = -(-t // chunk)
    pad = n * chunk - t
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, chunk, h, d).swapaxes(0, 1)
    ss = jnp.pad(segment_ids, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)  # padding -> segment 0

    @jax.checkpoint
    def one(args):
        qc, sc, start = args  # f[B, C, H, D], i32[B, C], i32[]
        causal = jnp.arange(t)[None, :] <= (start + jnp.arange(chunk))[:, None]  # bool[C, T]
        mask = causal[None] & (sc[:, :, None] == segment_ids[:, None, :]) & (sc != 0)[:, :, None]
        return gqa_attention(qc, k, v, mask)

    out = jax.lax.map(one, (qs, ss, jnp.arange(n, dtype=jnp.int32) * chunk))  # [n, B, C, H, D]
    return out.swapaxes(0, 1).reshape(b, n * chunk, h, d)[:, :t]


def _pallas_block_sizes(pallas_attention, blk: int):
    """Forward tiles of ``blk``; the backward kernels' tiles (which the kernel needs set, or its
    gradient raises) at JAX's defaults of 32, no larger than the padded row."""
    bwd = min(32, blk)
    return pallas_attention.BlockSizes(block_q=blk, block_k=blk, block_q_dkv=bwd, block_kv_dkv=bwd,
                                       block_q_dq=bwd, block_kv_dq=bwd)


def pallas_gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                         block: int = 128, interpret: bool = False) -> jax.Array:
    """Causal packed attention through JAX's Pallas GPU flash-attention kernel (``pallas.ops.gpu.attention.mha``).

    Flash attention with segment ids and a fused backward: no [T, T] scores in HBM and fully
    masked key blocks skipped. K/V heads are repeated to the query heads (the kernel has no GQA).
    Rows are padded to a multiple of the block with segment 0; segment-0 (padding) rows attend
    among themselves here instead of giving zeros as in dense_attention -- their outputs only ever
    reach other padding rows, which every loss masks. ``interpret=True`` runs the kernel on CPU (tests).
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    b, t, h, d = q.shape
    g = h // k.shape[2]
    if g > 1:
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    blk = min(block, max(16, 1 << (t - 1).bit_length()))  # small T: one power-of-two block
    pad = -t % blk
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    out = pallas_attention.mha(q, k, v, segment_ids.astype(jnp.int32), sm_scale=float(1.0 / d ** 0.5), causal=True,
                               block_sizes=_pallas_block_sizes(pallas_attention, blk),
                               interpret=interpret)
    return out[:, :t]


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

TRAIN_ATTENTION = ("dense", "chunked", "flash", "pallas_gpu", "tokamax", "splash")
AUTO = "auto"  # learner.attention_impl's default: resolve_train_attention picks per platform


def train_attention(name: str, chunk: int = 1024) -> AttentionFn:
    """The training attention for a config name (``learner.attention_impl``); all take (q, k, v, segment_ids).

    ``chunk``: query rows per chunk ('chunked') or the block size ('flash')."""
    if name == "dense":
        return dense_attention
    if name == "chunked":
        return functools.partial(chunked_attention, chunk=chunk)
    if name == "flash":
        from laminar_jax.model.flash import flash_attention

        return functools.partial(flash_attention, block=chunk)
    if name == "pallas_gpu":
        return pallas_gpu_attention
    if name in ("tokamax", "splash"):
        from laminar_jax.model import train_kernels

        return train_kernels.tokamax_attention if name == "tokamax" else train_kernels.splash_attention
    raise ValueError(f"attention_impl={name!r}: must be one of {list(TRAIN_ATTENTION)} "
                     "('auto' is resolved first: resolve_train_attention)")


def resolve_train_attention(name: str, platform: str, field: str = "learner.attention_impl") -> tuple[str, str]:
    """(the attention a learner on ``platform`` runs for config name ``name``, the reason).

    'auto': 'splash' on TPU, 'tokamax' on GPU when installed (else 'pallas_gpu'), 'dense' on CPU.
    An explicit kernel off its platform is an error naming the field."""
    from laminar_jax.model import train_kernels

    if name == AUTO:
        return train_kernels.auto_name(platform)
    needs = {"pallas_gpu": ("gpu", "cuda"), "tokamax": ("gpu", "cuda"), "splash": ("tpu",)}.get(name)
    if needs and platform not in needs:
        raise ValueError(f"{field}={name!r} runs on {needs[0].upper()}, not {platform}; use 'auto', 'dense', "
                         "'chunked' or 'flash'")
    return name, "set in the config"
