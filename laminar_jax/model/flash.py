"""Blockwise (flash) causal attention over packed rows in plain JAX, with a hand-written backward pass.

Why: `chunked_attention` bounds memory but still scores every query chunk against all T keys (its
``lax.map`` needs one shape). Here query block i visits only key blocks 0..i (a ``fori_loop`` with a
dynamic bound, which autodiff cannot transpose, hence ``custom_vjp``): about half the attention
FLOPs at long T, and only O(block^2) scores alive at once. Forward keeps the output and the
row log-sum-exp; backward recomputes each block's probabilities from them (FlashAttention-2).

Shapes: q f[B, T, H, D]; k, v f[B, T, Hkv, D] (H a multiple of Hkv); segment_ids i32[B, T] with 0 =
padding. Token i attends to token j iff j <= i, same segment, segment != 0 (as dense_attention);
rows with nothing to attend to give zeros. Math in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _blocks(x, n, c):
    """[B, n*c, ...] -> [n, B, c, ...]."""
    return x.reshape(x.shape[0], n, c, *x.shape[2:]).swapaxes(0, 1)


def _mask(sq, sk, i, j, c):
    """bool[B, 1, 1, c, c]: causal by absolute position within the row, same non-zero segment."""
    qpos = i * c + jnp.arange(c)
    kpos = j * c + jnp.arange(c)
    m = (kpos[None, :] <= qpos[:, None])[None] & (sq[:, :, None] == sk[:, None, :]) & (sq != 0)[:, :, None]
    return m[:, None, None]


def _scores(qb, kb, scale):
    # qb f32[B, c, Hkv, G, D], kb f32[B, c, Hkv, D] -> f32[B, Hkv, G, c, c]
    return jnp.einsum("bqkgd,bskd->bkgqs", qb, kb) * scale


def _forward(q, k, v, seg, c):
    """(out f32[n, B, c, Hkv, G, D], lse f32[n, B, Hkv, G, c]) over blocks of c tokens."""
    n = q.shape[0]
    b, _, hkv, g, d = q.shape[1:]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))

    def query_block(i):
        qb, sq = q[i], seg[i]

        def key_block(j, carry):
            m, l, acc = carry
            s = _scores(qb, k[j], scale)
            mask = _mask(sq, seg[j], i, j, c)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - safe[..., None]), 0.0)
            alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
            acc = acc * alpha[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p, v[j])
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc

        init = (jnp.full((b, hkv, g, c), -jnp.inf), jnp.zeros((b, hkv, g, c)), jnp.zeros((b, hkv, g, c, d)))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)  # inf: exp(s - lse) = 0
        return out.transpose(0, 3, 1, 2, 4), lse  # out -> [B, c, Hkv, G, D]

    return jax.lax.map(query_block, jnp.arange(n))


def _backward(q, k, v, seg, c, out, lse, dout):
    n = q.shape[0]
    d = q.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", dout, out)  # rowsum(dO * O)

    def query_block(i, carry):
        dq, dk, dv = carry
        qb, sq, do_i = q[i], seg[i], dout[i]

        def key_block(j, inner):
            dq_i, dk, dv = inner
            s = _scores(qb, k[j], scale)
            p = jnp.where(_mask(sq, seg[j], i, j, c), jnp.exp(s - lse[i][..., None]), 0.0)  # [B, Hkv, G, c, c]
            dv = dv.at[j].add(jnp.einsum("bkgqs,bqkgd->bskd", p, do_i))
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v[j])
            ds = p * (dp - delta[i][..., None]) * scale
            dq_i = dq_i + jnp.einsum("bkgqs,bskd->bqkgd", ds, k[j])
            dk = dk.at[j].add(jnp.einsum("bkgqs,bqkgd->bskd", ds, qb))
            return dq_i, dk, dv

        dq_i, dk, dv = jax.lax.fori_loop(0, i + 1, key_block, (jnp.zeros_like(qb), dk, dv))
        return dq.at[i].set(dq_i), dk, dv

    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    return jax.lax.fori_loop(0, n, query_block, zeros)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, c):
    return _forward(q, k, v, seg, c)[0]


def _flash_fwd(q, k, v, seg, c):
    out, lse = _forward(q, k, v, seg, c)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(c, res, dout):
    q, k, v, seg, out, lse = res
    dq, dk, dv = _backward(q, k, v, seg, c, out, lse, dout)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    block: int = 512) -> jax.Array:
    """Causal packed attention, blockwise with causal block skipping; same values as dense_attention."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    c = min(block, t)
    n = -(-t // c)
    pad = n * c - t
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    qf = jnp.pad(q.astype(jnp.float32), widths).reshape(b, n * c, hkv, h // hkv, d)
    kf, vf = (jnp.pad(x.astype(jnp.float32), widths) for x in (k, v))
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
    out = _flash(_blocks(qf, n, c), _blocks(kf, n, c), _blocks(vf, n, c), _blocks(seg, n, c), c)
    return out.swapaxes(0, 1).reshape(b, n * c, h, d)[:, :t].astype(q.dtype)
