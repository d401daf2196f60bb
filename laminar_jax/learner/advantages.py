"""Advantage estimators: small pure functions, registered by name (config picks one).

Token layout (see batch.py): position t of a row holds what is needed to *predict* token t+1,
so `mask[b, t] = 1` marks positions whose target is a response token. All estimators return
f32[B, T] advantages and returns, zero where mask == 0. Per-trajectory inputs are f32[S] over
trajectory slots; `seq_ids` i32[B, T] maps each token to its slot (packed rows hold several
trajectories; None means one trajectory per row, slot = row).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp


class AdvantageInputs(NamedTuple):
    rewards: jax.Array  # f32[S] scalar (verifiable) reward per trajectory
    group_ids: jax.Array  # i32[S] dense group id in [0, S): trajectories of one prompt share it
    token_rewards: jax.Array  # f32[B, T] per-token rewards (terminal reward + optional KL penalty)
    values: Optional[jax.Array]  # f32[B, T] old critic values (None without a critic)
    mask: jax.Array  # f32[B, T] 1 on response-target positions
    seq_ids: Optional[jax.Array] = None  # i32[B, T] trajectory slot per token (None: slot = row)


class AdvantageParams(NamedTuple):
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    whiten: bool = True
    eps: float = 1e-6


class AdvantageOutputs(NamedTuple):
    advantages: jax.Array  # f32[B, T]
    returns: jax.Array  # f32[B, T] value targets (GAE) or the broadcast advantage (GRPO/RLOO)


class _GaeCarry(NamedTuple):
    next_value: jax.Array  # f32[B] value of the next *response* position (0 past the end)
    next_adv: jax.Array  # f32[B]
    next_seq: jax.Array  # i32[B] trajectory slot of that position (a different one: terminal)


def row_seq_ids(mask: jax.Array) -> jax.Array:
    """i32[B, T]: slot = row, the unpacked layout."""
    return jnp.broadcast_to(jnp.arange(mask.shape[0], dtype=jnp.int32)[:, None], mask.shape)


def per_token(x_s: jax.Array, seq_ids: Optional[jax.Array], mask: jax.Array) -> jax.Array:
    """f32[S] per-trajectory values -> f32[B, T] on each trajectory's tokens (0 where mask = 0)."""
    if seq_ids is None:
        return x_s[:, None] * mask
    return x_s[jnp.maximum(seq_ids, 0)] * mask


def gae(token_rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float,
        lam: float, seq_ids: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """Token-level GAE as a reversed lax.scan over time.

    Over the masked positions t of a trajectory (masked-out positions are skipped, so "next" means
    the next position with mask 1 of the same trajectory; the last response position is terminal,
    V_next = 0; `seq_ids` tells packed trajectories apart, None = one per row):

        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lam * A_next(t)
        R_t     = A_t + V_t

    token_rewards, values, mask: f32[B, T]. Returns (advantages, returns) f32[B, T], 0 where mask=0.
    """

    def body(carry: _GaeCarry, x):
        r, v, m, sid = x  # f32[B] x3, i32[B]
        same = sid == carry.next_seq  # the next response position belongs to this trajectory
        next_value = jnp.where(same, carry.next_value, 0.0)
        delta = r + gamma * next_value - v
        adv = delta + gamma * lam * jnp.where(same, carry.next_adv, 0.0)
        on = m > 0
        new = _GaeCarry(jnp.where(on, v, carry.next_value), jnp.where(on, adv, carry.next_adv),
                        jnp.where(on, sid, carry.next_seq))
        return new, jnp.where(on, adv, 0.0)

    b = token_rewards.shape[0]
    seq_ids = row_seq_ids(mask) if seq_ids is None else seq_ids
    init = _GaeCarry(jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.float32), jnp.full((b,), -2, jnp.int32))
    xs = (token_rewards.T.astype(jnp.float32), values.T.astype(jnp.float32), mask.T, seq_ids.T)
    _, adv_tb = jax.lax.scan(body, init, xs, reverse=True)
    adv = adv_tb.T
    return adv, (adv + values) * mask


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / (std + eps) over the masked entries; 0 where mask = 0.

    std is the population std (divides by n) and eps is added to the std (AdvantageParams.eps,
    1e-6 by default). verl's masked_whiten uses the unbiased variance (n - 1) and adds 1e-8 to the
    variance instead; the two differ by a factor sqrt(n / (n - 1)), negligible for the thousands of
    tokens in a batch. We keep ours on purpose: it is defined for a single masked token.
    """
    n = jnp.maximum(mask.sum(), 1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) / (jnp.sqrt(var) + eps) * mask


class _GroupStats(NamedTuple):
    n: jax.Array  # f32[B] size of the row's group
    mean: jax.Array  # f32[B] group mean reward
    var: jax.Array  # f32[B] group variance, ddof=1 (two-pass)
    constant: jax.Array  # bool[B] every reward in the group is identical


def _group_stats(rewards: jax.Array, group_ids: jax.Array) -> _GroupStats:
    """Per-row group statistics, gathered back to f32[B] (segment reductions over group ids)."""
    b = rewards.shape[0]
    seg = lambda x: jax.ops.segment_sum(x, group_ids, num_segments=b)[group_ids]
    n = seg(jnp.ones_like(rewards))
    mean = seg(rewards) / n
    var = seg((rewards - mean) ** 2) / jnp.maximum(n - 1.0, 1.0)
    hi = jax.ops.segment_max(rewards, group_ids, num_segments=b)[group_ids]
    lo = jax.ops.segment_min(rewards, group_ids, num_segments=b)[group_ids]
    return _GroupStats(n, mean, var, hi == lo)


def grpo(rewards: jax.Array, group_ids: jax.Array, norm_by_std: bool, eps: float) -> jax.Array:
    """GRPO group-relative advantage per trajectory, f32[B].

        A_i = (r_i - mean_g) / (std_g + eps)   if norm_by_std   (std with ddof=1, as verl)
        A_i =  r_i - mean_g                     otherwise        (Dr.GRPO)

    over the n trajectories of i's group g. Groups of one trajectory, and groups whose rewards
    are all equal, get exactly A = 0 (no float residue of r - mean amplified by 1/eps). A group of
    one has no baseline (verl gives it r / (1 + eps)); the config refuses GRPO with
    runtime.samples_per_prompt = 1 instead of training nothing on it.
    """
    g = _group_stats(rewards, group_ids)
    centred = rewards - g.mean
    adv = centred / (jnp.sqrt(g.var) + eps) if norm_by_std else centred
    return jnp.where((g.n > 1) & ~g.constant, adv, 0.0)


def rloo(rewards: jax.Array, group_ids: jax.Array) -> jax.Array:
    """REINFORCE leave-one-out advantage per trajectory, f32[B].

        A_i = r_i - (1/(n-1)) * sum_{j in g, j != i} r_j  =  n/(n-1) * (r_i - mean_g)

    Groups of one trajectory and all-equal groups get exactly A = 0 (verl gives a lone trajectory
    A = r); the config refuses RLOO with runtime.samples_per_prompt = 1.
    """
    g = _group_stats(rewards, group_ids)
    adv = g.n / jnp.maximum(g.n - 1.0, 1.0) * (rewards - g.mean)
    return jnp.where((g.n > 1) & ~g.constant, adv, 0.0)


def _gae_estimator(inp: AdvantageInputs, hp: AdvantageParams) -> AdvantageOutputs:
    if inp.values is None:
        raise ValueError("adv_estimator='gae' needs critic values (learner.critic must not be 'none')")
    adv, ret = gae(inp.token_rewards, inp.values, inp.mask, hp.gamma, hp.lam, inp.seq_ids)
    if hp.whiten:
        adv = masked_whiten(adv, inp.mask, hp.eps)
    return AdvantageOutputs(adv, ret)


def _broadcast(adv_s: jax.Array, inp: AdvantageInputs) -> AdvantageOutputs:
    adv = per_token(adv_s, inp.seq_ids, inp.mask)
    return AdvantageOutputs(adv, adv)


def _grpo_estimator(inp: AdvantageInputs, hp: AdvantageParams) -> AdvantageOutputs:
    return _broadcast(grpo(inp.rewards, inp.group_ids, hp.norm_adv_by_std, hp.eps), inp)


def _rloo_estimator(inp: AdvantageInputs, hp: AdvantageParams) -> AdvantageOutputs:
    return _broadcast(rloo(inp.rewards, inp.group_ids), inp)


AdvantageFn = Callable[[AdvantageInputs, AdvantageParams], AdvantageOutputs]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "gae": _gae_estimator,
    "grpo": _grpo_estimator,
    "rloo": _rloo_estimator,
}


def compute_advantages(name: str, inp: AdvantageInputs, hp: AdvantageParams) -> AdvantageOutputs:
    """Look `name` up in ADVANTAGE_ESTIMATORS and apply it."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"adv_estimator={name!r}: must be one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](inp, hp)


def terminal_token_rewards(rewards: jax.Array, mask: jax.Array, seq_ids: Optional[jax.Array] = None) -> jax.Array:
    """f32[B, T]: reward r_s at trajectory s's last mask position (its last policy token), 0 elsewhere.

    The last mask position of each trajectory, wherever it lies: the mask may have holes
    (multi-turn observations) and rows may hold several trajectories (packing, `seq_ids`; None
    means one trajectory per row). A segment of policy tokens followed by an observation is not
    the end of its trajectory.
    """
    b, t = mask.shape
    seq_ids = row_seq_ids(mask) if seq_ids is None else seq_ids
    on = (mask > 0) & (seq_ids >= 0)
    flat = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
    slot = jnp.where(on, seq_ids, rewards.shape[0])  # off-mask tokens go to a spare segment
    last = jax.ops.segment_max(jnp.where(on, flat, -1).reshape(-1), slot.reshape(-1),
                               num_segments=rewards.shape[0] + 1)
    is_last = on & (flat == last[slot])
    return jnp.where(is_last, rewards[jnp.maximum(seq_ids, 0)], 0.0).astype(jnp.float32)
