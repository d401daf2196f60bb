"""Policy/value/entropy/KL loss terms, off-policy weights and loss aggregation (pure functions).

All per-token inputs are f32[B, T] aligned to targets (position t scores token t+1); `mask` is 1
on response-target positions. Log-prob vocabulary:
  current   logp       -- params being differentiated
  proximal  logp_prox  -- learner params at the start of the Learner.step (computed once, before
                          the update loop); also called "old"
  behaviour logp_behav -- what the rollout recorded while sampling (the generating version)
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp


class AggNorm(NamedTuple):
    """Denominators of an aggregation, computed over a whole mini-batch so that summing the
    aggregated losses of its micro-batches gives exactly the mini-batch aggregate."""

    tokens: jax.Array  # f32[] number of mask tokens (>= 1)
    seqs: jax.Array  # f32[] number of rows with at least one mask token (>= 1)


def agg_norm(mask: jax.Array, seq_tokens: Optional[jax.Array] = None) -> AggNorm:
    """Denominators over `mask`; with `seq_tokens` (packed rows) sequences are counted per token:
    S = sum_t m_t / n_seq(t), each trajectory's n tokens adding up to exactly 1."""
    if seq_tokens is None:
        seqs = (mask.sum(-1) > 0).sum().astype(jnp.float32)
    else:
        seqs = (mask / jnp.maximum(seq_tokens, 1.0)).sum()
    return AggNorm(jnp.maximum(mask.sum(), 1.0), jnp.maximum(seqs, 1.0))


def aggregate(x: jax.Array, mask: jax.Array, mode: str, norm: Optional[AggNorm] = None,
              seq_tokens: Optional[jax.Array] = None) -> jax.Array:
    """Reduce per-token values f32[B, T] to a scalar.

        token-mean:          sum_{b,t} m x / sum_{b,t} m
        seq-mean-token-mean: (1/S) sum_s [ sum_{t in s} m x / n_s ]   (S = sequences with any mask)
        seq-mean-token-sum:  (1/S) sum_s   sum_{t in s} m x
    Sequences are rows, or with `seq_tokens` f32[B, T] (n_s of each token's trajectory; packed
    rows) trajectories: then sum_s sum_{t in s} m x / n_s = sum_t m x / seq_tokens, so the
    aggregate stays a per-token sum that any row split (micro-batches) preserves.
    Fully masked sequences contribute 0 and are not counted in S.
    """
    norm = agg_norm(mask, seq_tokens) if norm is None else norm
    xm = x * mask
    if mode == "token-mean":
        return xm.sum() / norm.tokens
    if mode == "seq-mean-token-mean":
        if seq_tokens is not None:
            return (xm / jnp.maximum(seq_tokens, 1.0)).sum() / norm.seqs
        return (xm.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum() / norm.seqs
    if mode == "seq-mean-token-sum":
        return xm.sum() / norm.seqs
    raise ValueError(f"loss_agg={mode!r}: must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum")


class PolicyLossOut(NamedTuple):
    loss: jax.Array  # f32[B, T] per-token loss (before weights and aggregation)
    clipped: jax.Array  # f32[B, T] 1 where the clipped branch was taken
    dual_clipped: jax.Array  # f32[B, T] 1 where the dual clip bound was taken
    ratio: jax.Array  # f32[B, T] pi/pi_old


def ppo_clip_loss(logp: jax.Array, logp_old: jax.Array, adv: jax.Array, eps_low: float, eps_high: float,
                  dual_clip_c: Optional[float] = None) -> PolicyLossOut:
    """Per-token PPO clipped surrogate (clip-higher when eps_high > eps_low), optional dual clip.

        r   = exp(logp - logp_old)
        L   = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        dual clip (c > 1), only where A < 0:  L = min(L, -c A)
    """
    log_ratio = jnp.clip(logp - logp_old, -20.0, 20.0)  # keeps exp finite for wildly stale tokens
    ratio = jnp.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(l1, l2)
    clipped = (l2 > l1).astype(jnp.float32)
    dual = jnp.zeros_like(loss)
    if dual_clip_c is not None:
        l3 = -adv * dual_clip_c
        dual = ((adv < 0) & (loss > l3)).astype(jnp.float32)
        loss = jnp.where(adv < 0, jnp.minimum(loss, l3), loss)
    return PolicyLossOut(loss, clipped, dual, ratio)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array,
               clip: Optional[float]) -> tuple[jax.Array, jax.Array]:
    """Per-token clipped value loss and the 'clipped branch taken' indicator.

        v_c = clip(v, v_old - clip, v_old + clip)
        L   = 0.5 * max((v - R)^2, (v_c - R)^2)        (0.5 (v - R)^2 when clip is None)

    v_c is computed by clipping v itself, not as v_old + clip(v - v_old): the latter differs from v
    by float32 round-off even when nothing is clipped, and the indicator then counts such tokens.
    """
    l1 = (values - returns) ** 2
    if clip is None:
        return 0.5 * l1, jnp.zeros_like(l1)
    vc = jnp.clip(values, old_values - clip, old_values + clip)
    l2 = (vc - returns) ** 2
    return 0.5 * jnp.maximum(l1, l2), (l2 > l1).astype(jnp.float32)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Per-position entropy of softmax(logits): H = logsumexp(z) - sum_v p_v z_v. f[..., V] -> f32[...]."""
    z = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(z, axis=-1)
    p = jnp.exp(z - logz[..., None])
    return logz - jnp.sum(p * z, axis=-1)


def kl_k1(logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
    """k1 = log(pi / pi_ref) (unbiased, high variance, can be negative)."""
    return logp - logp_ref


def kl_k2(logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
    """k2 = 0.5 * (log(pi / pi_ref))^2."""
    return 0.5 * (logp - logp_ref) ** 2


def kl_k3(logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
    """k3 = r - 1 - log r with r = pi_ref / pi (unbiased, >= 0; Schulman's estimator), clamped to [-10, 10].

    k3 is unbounded: logp = -3, logp_ref = 0 gives 16.09, and its gradient 1 - pi_ref/pi grows
    like e^d when pi_ref >> pi. As verl does, the value is clamped to [-10, 10]; beyond the clamp
    the gradient is 0, so a single very unlikely token cannot dominate the update. The inner clip of
    d keeps exp() finite before the clamp.
    """
    d = jnp.clip(logp_ref - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - 1.0 - d, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(name: str, logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
    if name not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={name!r}: must be one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name](logp, logp_ref)


class OffPolicyOut(NamedTuple):
    logp_old: jax.Array  # f32[B, T] the log-probs the PPO ratio and clip are taken against
    weight: jax.Array  # f32[B, T] per-token importance weight (no gradient) multiplying the policy loss


def _none(logp_prox, logp_behav, cap):
    """'none': the behaviour policy is the old policy; no weight. (Ratio pi/pi_behav.)"""
    return OffPolicyOut(logp_behav, jnp.ones_like(logp_behav))


def _tis(logp_prox, logp_behav, cap):
    """'tis' (truncated IS): old = proximal; w = min(exp(logp_prox - logp_behav), cap)."""
    w = jnp.minimum(jnp.exp(jnp.clip(logp_prox - logp_behav, -20.0, 20.0)), cap)
    return OffPolicyOut(logp_prox, w)


def _decoupled(logp_prox, logp_behav, cap):
    """'decoupled' PPO: clip against proximal; w = exp(logp_prox - logp_behav), tokens with w > cap get w = 0."""
    w = jnp.exp(jnp.clip(logp_prox - logp_behav, -20.0, 20.0))
    return OffPolicyOut(logp_prox, jnp.where(w <= cap, w, 0.0))


OFF_POLICY: dict[str, Callable[[jax.Array, jax.Array, float], OffPolicyOut]] = {
    "none": _none, "tis": _tis, "decoupled": _decoupled}


def off_policy_correction(name: str, logp_prox: jax.Array, logp_behav: jax.Array, cap: float) -> OffPolicyOut:
    """Pick the old log-probs and importance weight for the named correction (weights carry no gradient)."""
    if name not in OFF_POLICY:
        raise ValueError(f"off_policy={name!r}: must be one of {sorted(OFF_POLICY)}")
    out = OFF_POLICY[name](logp_prox, logp_behav, cap)
    return OffPolicyOut(jax.lax.stop_gradient(out.logp_old), jax.lax.stop_gradient(out.weight))
