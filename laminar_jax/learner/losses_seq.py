"""Sequence-level policy ratio (GSPO) and sequence-level importance corrections (pure functions).

Same vocabulary as losses.py (current logp, proximal logp_prox, behaviour logp_behav; per-token
f32[B, T] aligned to targets, `mask` 1 on response-target positions). A trajectory is a segment
of a row: `segment_ids` i32[B, T] numbers the trajectories of a row 1, 2, ... (0 = padding), so
every per-sequence quantity here is a per-row segment sum and survives packing and any split of
rows into micro-batches. Per-sequence values come back broadcast onto the sequence's tokens.

For trajectory i with response tokens t (mask 1; n_i of them):

  GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):
      s_i  = (pi(y_i) / pi_old(y_i))^(1/n_i) = exp((1/n_i) sum_t (logp_t - logp_old_t))
      J    = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
  computed per token as the paper's GSPO-token form with A_{i,t} = A_i,
      s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]      (value s_i; gradient s_i grad log pi(y_t))
  so that with loss_agg='seq-mean-token-mean' the loss and its gradient are exactly GSPO's
  (the same construction as verl's compute_policy_loss_gspo).

  Sequence-level importance weights of the behaviour policy (the rollout's sampling) against
  the proximal policy (learner params at the start of the step):
      log rho_i = sum_t (logp_prox_t - logp_behav_t)          seq_is_ratio='product'
      log rho_i = (1/n_i) sum_t (logp_prox_t - logp_behav_t)  seq_is_ratio='geometric'
      seq_tis:  w_i = min(rho_i, high)                        (truncated IS; verl's rollout_is='sequence')
      seq_mask: w_i = 1 if low <= rho_i <= high else 0        (rejection; verl's seq_sum_k1 / seq_mean_k1,
                                                               which bound 1/rho_i: the same band when low = 1/high)
  The weight multiplies every token loss of trajectory i and carries no gradient; the PPO ratio is
  taken against the proximal policy, as with off_policy='tis'. log rho_i is clamped to [-20, 20]
  before exp (as verl does), which changes nothing inside any band a config can name.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from laminar_jax.learner.config import SEQ_OFF_POLICY
from laminar_jax.learner.losses import OffPolicyOut, PolicyLossOut, off_policy_correction, ppo_clip_loss

LOG_BOUND = 20.0  # exp(20) ~ 4.9e8: finite in float32 and beyond every band


def seq_sum(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """f32[B, T]: the sum of x over each token's trajectory (its row's segment), on every token of it.

    Padding (segment 0) gets the sum over the row's padding; callers multiply by the mask."""
    t = x.shape[-1]

    def row(xr, sr):
        return jax.ops.segment_sum(xr, sr, num_segments=t + 1)[sr]

    return jax.vmap(row)(x, segment_ids)


def seq_log_ratio(logp_num: jax.Array, logp_den: jax.Array, mask: jax.Array, segment_ids: jax.Array,
                  how: str) -> jax.Array:
    """f32[B, T]: log of trajectory i's ratio pi_num(y_i)/pi_den(y_i), 'product' (sum of the token log
    ratios) or 'geometric' (their mean), on each of its response tokens; 0 off the mask."""
    total = seq_sum((logp_num - logp_den) * mask, segment_ids)
    if how == "geometric":
        total = total / jnp.maximum(seq_sum(mask, segment_ids), 1.0)
    elif how != "product":
        raise ValueError(f"seq_is_ratio={how!r}: must be 'geometric' or 'product'")
    return total * mask


def gspo_clip_loss(logp: jax.Array, logp_old: jax.Array, adv: jax.Array, mask: jax.Array,
                   segment_ids: jax.Array, eps_low: float, eps_high: float,
                   dual_clip_c: Optional[float] = None) -> PolicyLossOut:
    """Per-token GSPO loss (module doc): PPO's clipped surrogate on s_{i,t}, whose value is the
    trajectory's s_i and whose gradient reaches token t's own log-prob only. `adv` must be constant
    over a trajectory's tokens (GRPO/RLOO). The dual clip, if set, bounds -A s_i at -c A for A < 0."""
    mean_log_ratio = jax.lax.stop_gradient(seq_log_ratio(logp, logp_old, mask, segment_ids, "geometric"))
    # ppo_clip_loss takes r = exp(logp - logp_old'); logp_old' = sg[logp] - sg[log s_i] gives
    # log r = logp - sg[logp] + sg[log s_i]: value log s_i, gradient that of logp.
    return ppo_clip_loss(logp, jax.lax.stop_gradient(logp) - mean_log_ratio, adv, eps_low, eps_high, dual_clip_c)


class SeqBand(NamedTuple):
    """Settings of a sequence-level correction (LearnerSection.seq_is_*)."""

    how: str  # 'product' | 'geometric'
    high: float
    low: float  # seq_mask only


class Correction(NamedTuple):
    out: OffPolicyOut  # old log-probs and the per-token weight (no gradient)
    flagged: jax.Array  # f32[B, T] 1 on the tokens of trajectories capped (seq_tis) or dropped (seq_mask)


def seq_correction(name: str, logp_prox: jax.Array, logp_behav: jax.Array, mask: jax.Array,
                   segment_ids: jax.Array, band: SeqBand) -> Correction:
    """'seq_tis' or 'seq_mask' (module doc): old = proximal, one weight per trajectory."""
    log_rho = jnp.clip(seq_log_ratio(logp_prox, logp_behav, mask, segment_ids, band.how), -LOG_BOUND, LOG_BOUND)
    if name == "seq_tis":
        flagged = log_rho > jnp.log(band.high)
        weight = jnp.minimum(jnp.exp(log_rho), band.high)
    elif name == "seq_mask":
        flagged = (log_rho > jnp.log(band.high)) | (log_rho < jnp.log(band.low))
        weight = jnp.where(flagged, 0.0, 1.0)
    else:
        raise ValueError(f"off_policy={name!r}: not a sequence-level correction {list(SEQ_OFF_POLICY)}")
    out = OffPolicyOut(jax.lax.stop_gradient(logp_prox), jax.lax.stop_gradient(weight * mask))
    return Correction(out, flagged.astype(jnp.float32) * mask)


def correction(section, logp_prox: jax.Array, logp_behav: jax.Array, mask: jax.Array,
               segment_ids: jax.Array) -> Correction:
    """The off-policy correction `section.off_policy` names, token-level (losses.py) or sequence-level."""
    if section.off_policy in SEQ_OFF_POLICY:
        low = section.seq_is_low if section.seq_is_low is not None else 1.0 / section.seq_is_high
        band = SeqBand(section.seq_is_ratio, section.seq_is_high, low)
        return seq_correction(section.off_policy, logp_prox, logp_behav, mask, segment_ids, band)
    out = off_policy_correction(section.off_policy, logp_prox, logp_behav, section.tis_cap)
    return Correction(out, jnp.zeros_like(mask))


def policy_loss(section, logp: jax.Array, logp_old: jax.Array, adv: jax.Array, mask: jax.Array,
                segment_ids: jax.Array) -> PolicyLossOut:
    """Per-token policy loss at `section.ratio_level`: PPO's per-token ratio or GSPO's per sequence."""
    if section.ratio_level == "sequence":
        return gspo_clip_loss(logp, logp_old, adv, mask, segment_ids, section.clip_eps_low, section.clip_eps_high,
                              section.dual_clip_c)
    return ppo_clip_loss(logp, logp_old, adv, section.clip_eps_low, section.clip_eps_high, section.dual_clip_c)
