"""Training attention from maintained kernel libraries: tokamax on GPU, splash attention on TPU.

Both take the training contract of ``attention.dense_attention``: q f[B, T, H, D], k/v f[B, T, Hkv, D],
segment_ids i32[B, T] (0 = padding), causal within a segment, and have fused backward kernels.

- ``tokamax`` (``learner.attention_impl='tokamax'``): tokamax's flash attention, Mosaic GPU on
  Hopper/Blackwell (sm90/sm100) and Triton elsewhere (tokamax falls back from the first to the
  second when it raises NotImplementedError). Packed rows become a per-query ``k_start`` (the first
  token of its segment) with ``is_causal``: the kernels skip key blocks before the smallest
  ``k_start`` of a query block and past the diagonal, so no [T, T] mask exists. Segments must be
  contiguous runs (how packing lays them out). tokamax is an optional dependency
  (``pip install tokamax``), imported when this attention is first built.
- ``splash`` (``learner.attention_impl='splash'``): JAX's splash attention
  (``pallas.ops.tpu.splash_attention``) with a causal mask and ``SegmentIds``; GQA runs as one
  multi-query kernel per KV head (vmapped). Rows are padded to the block (128) with segment 0.

Padding tokens (segment 0) attend among themselves here, where dense gives them zeros; their outputs
only ever reach other padding tokens, which every loss masks, so values and gradients of real tokens
are those of dense.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

INSTALL_TOKAMAX = "learner.attention_impl='tokamax' needs the tokamax kernel library: pip install tokamax"


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """i32[B, T]: for each token, the index of the first token of its run of equal segment ids.
    Padding (segment 0) tokens start at themselves (each attends only itself)."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    first = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    starts = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
    return jnp.where(segment_ids == 0, idx, starts)


def _absl_flags_parsed() -> None:
    """tokamax reads its options from absl flags and, if no absl app parsed them, parses sys.argv on
    first use, which fails on any argparse/pytest argument (e.g. '-q'). Unparsed flags keep their
    defaults here; an absl app's parsed flags are left alone."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def tokamax_ops(implementation: Sequence[str]) -> list[Any]:
    """tokamax's attention ops by name ('mosaic' = Mosaic GPU, 'triton', 'xla' = its XLA reference)."""
    try:
        from tokamax._src.ops.attention import api
    except ImportError as e:
        raise ImportError(INSTALL_TOKAMAX) from e
    _absl_flags_parsed()
    names = {"mosaic": "mosaic_gpu"}
    return [api.IMPLEMENTATIONS[names.get(n, n)] for n in implementation]


def tokamax_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                      implementation: Sequence[Any] = ("mosaic", "triton")) -> jax.Array:
    """Causal packed attention through tokamax's flash attention kernels (forward and backward).

    ``implementation``: names (see tokamax_ops) or tokamax op objects, tried in order; the first
    that does not raise NotImplementedError (e.g. Mosaic GPU before Hopper) runs.
    """
    from tokamax._src.ops.attention import base

    _absl_flags_parsed()
    d = q.shape[-1]
    mask = base.Mask(k_start=segment_starts(segment_ids)[:, None, :], is_causal=True)  # [B, 1(heads), T]
    ops = [op for op in implementation if not isinstance(op, str)] or tokamax_ops(implementation)
    errors = []
    for op in ops:
        try:
            return op(q, k, v, mask=mask, logits_scale=float(1.0 / d ** 0.5)).astype(q.dtype)
        except NotImplementedError as e:  # this kernel cannot run here: try the next
            errors.append(f"{type(op).__name__}: {e}")
    raise NotImplementedError("no tokamax attention kernel runs here: " + "; ".join(errors))


SPLASH_BLOCK = 128


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, group: int, block: int, interpret: bool):
    """One multi-query splash kernel (a KV head's ``group`` query heads) for rows of t tokens;
    built once per shape (its mask tables are computed on the host)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(group)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     block: int = SPLASH_BLOCK, interpret: bool = False) -> jax.Array:
    """Causal packed attention through JAX's TPU splash attention (forward and backward kernels)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    pad = -t % block
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    tp = t + pad
    kernel = _splash_kernel(tp, g, block, interpret)
    qs = (q * jnp.asarray(1.0 / d ** 0.5, q.dtype)).reshape(b, tp, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    seg = segment_ids.astype(jnp.int32)

    def one_head(qh, kh, vh, sh):  # [G, T, D], [T, D], [T, D], [T]
        return kernel(qh, kh, vh, splash.SegmentIds(q=sh, kv=sh))

    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None))  # over KV heads
    out = jax.vmap(per_row)(qs, ks, vs, seg)  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, d)[:, :t].astype(q.dtype)


def auto_name(platform: str, *, tokamax_installed: Optional[bool] = None) -> tuple[str, str]:
    """(learner.attention_impl, reason) that 'auto' runs on a platform: 'splash' on TPU, 'tokamax' on
    GPU when installed (else JAX's 'pallas_gpu'), 'dense' on CPU."""
    if platform == "tpu":
        return "splash", "TPU: splash attention"
    if platform in ("gpu", "cuda", "rocm"):
        if tokamax_installed is None:
            import importlib.util

            tokamax_installed = importlib.util.find_spec("tokamax") is not None
        if tokamax_installed:
            return "tokamax", "GPU: tokamax flash attention"
        return "pallas_gpu", "GPU without tokamax (pip install tokamax): JAX's Pallas GPU attention"
    return "dense", f"{platform}: dense (the portable default)"
