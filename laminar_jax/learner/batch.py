"""TrainBatch (the learner's input pytree) and host-side collation of trajectories.

Layout: one trajectory per row, prompt then response, right-padded to a bucketed length T.
Position t holds token t and is scored on its *target*, token t+1. For a row with prompt length P
and response length R (L = P + R tokens):

    tokens[t]   = seq[t]                     t < L
    targets[t]  = seq[t + 1]                 t < L - 1
    loss_mask[t]= 1  for t in [P-1, L-2]     (the target is a response token)
    behaviour_logprobs[P-1+j] = trajectory.behaviour_logprobs[j]

Group advantages (GRPO/RLOO) are NOT computed here: the learner computes every advantage on
device, once per Learner.step over the whole batch, before splitting it into mini-batches
(see step.make_prepare_fn), so groups are never split by mini-batching.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from laminar_jax.types import Trajectory


class TrainBatch(NamedTuple):
    tokens: Any  # i32[B, T] input ids (prompt + response, right-padded)
    targets: Any  # i32[B, T] tokens shifted left by one (targets[t] = tokens[t+1])
    positions: Any  # i32[B, T] 0..L-1, 0 on padding
    segment_ids: Any  # i32[B, T] 1 on real tokens, 0 on padding
    loss_mask: Any  # f32[B, T] 1 where targets[t] is a response token
    behaviour_logprobs: Any  # f32[B, T] rollout-recorded log-prob of targets[t] (0 off-mask)
    rewards: Any  # f32[B] scalar reward per trajectory
    group_ids: Any  # i32[B] dense group id per prompt_uid (padding rows get unique ids)
    versions: Any  # i32[B] generating weight version (-1 on padding rows)
    # Filled on device by the learner's prepare pass (zeros after collate):
    old_logprobs: Any  # f32[B, T] the PPO "old" log-probs (behaviour or proximal, see losses.py)
    prox_logprobs: Any  # f32[B, T] proximal log-probs (learner params at batch start)
    ref_logprobs: Any  # f32[B, T] reference-policy log-probs
    old_values: Any  # f32[B, T] critic values at batch start
    advantages: Any  # f32[B, T]
    returns: Any  # f32[B, T]


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (bounded set of padded lengths -> bounded recompiles)."""
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"sequence of {n} tokens exceeds the largest seq_len_bucket {buckets[-1]}")


def _check(tr: Trajectory, i: int) -> None:
    where = f"trajectory[{i}] uid={tr.uid!r}"
    if tr.reward is None:
        raise ValueError(f"{where}: reward is None (score trajectories before the learner sees them)")
    if len(tr.prompt_ids) < 1:
        raise ValueError(f"{where}: empty prompt_ids (need >= 1 token to predict the first response token)")
    if len(tr.behaviour_logprobs) != len(tr.response_ids):
        raise ValueError(f"{where}: behaviour_logprobs has {len(tr.behaviour_logprobs)} entries, "
                         f"response_ids has {len(tr.response_ids)}")


def collate(trajectories: Sequence[Trajectory], buckets: Sequence[int], pad_token_id: int = 0,
            row_multiple: int = 1) -> TrainBatch:
    """Pad trajectories into a numpy TrainBatch.

    T = bucket_length(longest prompt+response). B = len(trajectories) rounded up to a multiple of
    `row_multiple` with fully masked padding rows (so the batch divides over the mesh and the
    micro/mini-batch split).
    """
    if not trajectories:
        raise ValueError("collate: empty trajectory list")
    for i, tr in enumerate(trajectories):
        _check(tr, i)
    lengths = [tr.num_tokens for tr in trajectories]
    try:
        t = bucket_length(max(lengths), buckets)
    except ValueError as e:
        i = int(np.argmax(lengths))
        raise ValueError(f"trajectory[{i}] uid={trajectories[i].uid!r}: {e}") from None
    n = len(trajectories)
    b = -(-n // row_multiple) * row_multiple
    tokens = np.full((b, t), pad_token_id, np.int32)
    targets = np.full((b, t), pad_token_id, np.int32)
    positions = np.zeros((b, t), np.int32)
    segment_ids = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.float32)
    blp = np.zeros((b, t), np.float32)
    rewards = np.zeros((b,), np.float32)
    versions = np.full((b,), -1, np.int32)
    group_of: dict[str, int] = {}
    group_ids = np.zeros((b,), np.int32)
    for i, tr in enumerate(trajectories):
        seq = np.concatenate([np.asarray(tr.prompt_ids, np.int32), np.asarray(tr.response_ids, np.int32)])
        p, length = len(tr.prompt_ids), len(seq)
        tokens[i, :length] = seq
        targets[i, :length - 1] = seq[1:]
        positions[i, :length] = np.arange(length)
        segment_ids[i, :length] = 1
        loss_mask[i, p - 1:length - 1] = 1.0
        blp[i, p - 1:length - 1] = np.asarray(tr.behaviour_logprobs, np.float32)
        rewards[i] = tr.reward
        versions[i] = tr.version
        group_ids[i] = group_of.setdefault(tr.prompt_uid, len(group_of))
    group_ids[n:] = len(group_of) + np.arange(b - n)  # padding rows: singleton groups (advantage 0)
    zeros = np.zeros((b, t), np.float32)
    return TrainBatch(tokens, targets, positions, segment_ids, loss_mask, blp, rewards, group_ids, versions,
                      zeros, zeros, zeros, zeros, zeros, zeros)


class Staleness(NamedTuple):
    mean: float
    max: int
    min: int


def staleness(versions: np.ndarray, learner_version: int) -> Staleness:
    """learner_version - generating version, over real rows (version >= 0)."""
    v = np.asarray(versions)
    v = v[v >= 0]
    if v.size == 0:
        return Staleness(0.0, 0, 0)
    s = learner_version - v
    return Staleness(float(s.mean()), int(s.max()), int(s.min()))
