"""TrainBatch (the learner's input pytree) and host-side collation of trajectories.

Layout: each trajectory is one *segment* (prompt then response) of a row. Unpacked, a row holds one
trajectory right-padded to a bucketed length T; packed (``pack_length``), rows of exactly
``pack_length`` tokens hold several trajectories back to back (first-fit decreasing), told apart
by segment_ids (1, 2, ... within a row), positions restarting at 0 for each, so long-tail batches
do not pay for padding up to their longest response. Position t holds token t and is scored on
its *target*, token t+1. For a segment starting at offset o with prompt length P and response
length R (L = P + R tokens), relative positions t = 0..L-1 at o + t:

    tokens[t]   = seq[t]                     t < L
    targets[t]  = seq[t + 1]                 t < L - 1
    loss_mask[t]= 1  for t in [P-1, L-2]     (the target is a response token)
    behaviour_logprobs[P-1+j] = trajectory.behaviour_logprobs[j]

Multi-turn trajectories carry a policy mask over their response (1 generated, 0 observation
tokens from the environment): loss_mask[P-1+j] = policy_mask[j], so the mask has holes, and the
behaviour log-probs (one per policy token) fill the policy positions in order.

Group advantages (GRPO/RLOO) are NOT computed here: the learner computes every advantage on
device, once per Learner.step over the whole batch, before splitting it into mini-batches
(see step.make_prepare_fn), so groups are never split by mini-batching.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from laminar_jax.types import Trajectory


class TrainBatch(NamedTuple):
    tokens: Any  # i32[B, T] input ids (prompt + response, right-padded)
    targets: Any  # i32[B, T] tokens shifted left by one (targets[t] = tokens[t+1])
    positions: Any  # i32[B, T] 0..L-1, 0 on padding
    segment_ids: Any  # i32[B, T] 1 on real tokens, 0 on padding
    loss_mask: Any  # f32[B, T] 1 where targets[t] is a response token
    behaviour_logprobs: Any  # f32[B, T] rollout-recorded log-prob of targets[t] (0 off-mask)
    rewards: Any  # f32[S] scalar reward per trajectory slot (S = B unpacked)
    group_ids: Any  # i32[S] dense group id per prompt_uid (padding slots get unique ids)
    versions: Any  # i32[S] generating weight version (-1 on padding slots)
    seq_ids: Any  # i32[B, T] trajectory slot of each token (-1 on padding)
    # Filled on device by the learner's prepare pass (zeros after collate):
    old_logprobs: Any  # f32[B, T] the PPO "old" log-probs (behaviour or proximal, see losses.py)
    prox_logprobs: Any  # f32[B, T] proximal log-probs (learner params at batch start)
    ref_logprobs: Any  # f32[B, T] reference-policy log-probs
    old_values: Any  # f32[B, T] critic values at batch start
    advantages: Any  # f32[B, T]
    returns: Any  # f32[B, T]
    seq_tokens: Any  # f32[B, T] response-target count of the token's trajectory (0 off-mask)


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (bounded set of padded lengths -> bounded recompiles)."""
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"sequence of {n} tokens exceeds the largest seq_len_bucket {buckets[-1]}")


def row_bucket(n: int, per_doubling: int = 1) -> int:
    """Smallest row-count bucket >= n. Buckets are the powers of two, each doubling split into
    `per_doubling` equal steps (rounded up): 1 -> 1, 2, 4, 8, ...; 2 -> 1, 2, 3, 4, 6, 8, 12, ...
    Finer buckets pad fewer rows and give the learner more shapes to compile."""
    if n <= 1:
        return 1
    low = 1 << (int(n).bit_length() - 1)  # the largest power of two <= n
    return next(b for t in range(per_doubling + 1) if (b := low + -(-t * low // per_doubling)) >= n)


def stratified_order(rng: np.random.Generator, lengths: Sequence[int], parts: int) -> np.ndarray:
    """A random order whose `parts` consecutive parts (np.array_split) need about the same room:
    the trajectories, longest first (ties in random order), are dealt a stratum of `parts` at a
    time, one to each part at random. Every part is still a random draw (one of each stratum), and
    every trajectory is in exactly one; the packed mini-batches then need near-equal row counts, so
    fewer rows of the fullest one are padding in all the others."""
    n = len(lengths)
    by_length = rng.permutation(n)
    by_length = by_length[np.argsort(-np.asarray(lengths)[by_length], kind="stable")]
    sizes = [len(a) for a in np.array_split(np.arange(n), parts)]
    dealt: list[list[int]] = [[] for _ in range(parts)]
    for start in range(0, n, parts):
        stratum = by_length[start:start + parts]
        open_parts = [j for j in range(parts) if len(dealt[j]) < sizes[j]]
        for j, i in zip(rng.permutation(open_parts)[:len(stratum)], stratum):
            dealt[j].append(int(i))
    return np.concatenate([np.asarray(d, np.int64) for d in dealt])


def _check(tr: Trajectory, i: int) -> None:
    where = f"trajectory[{i}] uid={tr.uid!r}"
    if tr.reward is None:
        raise ValueError(f"{where}: reward is None (score trajectories before the learner sees them)")
    if len(tr.prompt_ids) < 1:
        raise ValueError(f"{where}: empty prompt_ids (need >= 1 token to predict the first response token)")
    if tr.policy_mask is not None and len(tr.policy_mask) != len(tr.response_ids):
        raise ValueError(f"{where}: policy_mask has {len(tr.policy_mask)} entries, "
                         f"response_ids has {len(tr.response_ids)}")
    if len(tr.behaviour_logprobs) != tr.num_policy_tokens:
        raise ValueError(f"{where}: behaviour_logprobs has {len(tr.behaviour_logprobs)} entries, "
                         f"response_ids has {tr.num_policy_tokens} policy tokens")


def collate(trajectories: Sequence[Trajectory], buckets: Sequence[int], pad_token_id: int = 0,
            row_multiple: int = 1, pack_length: int = 0, mini_batches: int = 1,
            order: Optional[Sequence[int]] = None, rows_per_doubling: int = 1,
            pack_lengths: Sequence[int] = ()) -> TrainBatch:
    """Pad (or pack) trajectories into a numpy TrainBatch.

    Unpacked (pack_length=0): T = bucket_length(longest prompt+response), one trajectory per row,
    B = S = len(trajectories) rounded up to a multiple of `row_multiple` (fully masked padding rows,
    so the batch divides over the mesh and the micro/mini-batch split).
    Packed: T = the smallest of `pack_lengths` (sorted, the last = pack_length; default: pack_length
    alone) that holds the longest trajectory (rows attend within themselves: shorter rows cost less).
    The trajectories, taken in `order` (a permutation; default as given), are split into
    `mini_batches` consecutive parts; part j is packed first-fit decreasing into
    rows [j R, (j+1) R) where R = the most rows any part needs, rounded up to
    row_multiple / mini_batches x a row_bucket (`rows_per_doubling` buckets per power of two: few
    distinct shapes -> few compilations). So a
    mini-batch is a set of whole trajectories chosen without regard to the mesh: only the number
    of fully masked padding rows depends on it. S = len(trajectories) rounded up to row_multiple.
    """
    if not trajectories:
        raise ValueError("collate: empty trajectory list")
    for i, tr in enumerate(trajectories):
        _check(tr, i)
    lengths = [tr.num_tokens for tr in trajectories]
    n = len(trajectories)
    s_slots = -(-n // row_multiple) * row_multiple
    if pack_length:
        too_long = [i for i, length in enumerate(lengths) if length > pack_length]
        if too_long:
            i = too_long[0]
            raise ValueError(f"trajectory[{i}] uid={trajectories[i].uid!r}: {lengths[i]} tokens exceed "
                             f"learner.pack_length={pack_length}")
        t = bucket_length(max(lengths), pack_lengths or (pack_length,))
        placement, b = _pack_blocks(lengths, t, row_multiple, mini_batches, order, rows_per_doubling)
    else:
        try:
            t = bucket_length(max(lengths), buckets)
        except ValueError as e:
            i = int(np.argmax(lengths))
            raise ValueError(f"trajectory[{i}] uid={trajectories[i].uid!r}: {e}") from None
        placement, b = [(i, 0) for i in range(n)], s_slots
    tokens = np.full((b, t), pad_token_id, np.int32)
    targets = np.full((b, t), pad_token_id, np.int32)
    positions = np.zeros((b, t), np.int32)
    segment_ids = np.zeros((b, t), np.int32)
    seq_ids = np.full((b, t), -1, np.int32)
    loss_mask = np.zeros((b, t), np.float32)
    blp = np.zeros((b, t), np.float32)
    rewards = np.zeros((s_slots,), np.float32)
    versions = np.full((s_slots,), -1, np.int32)
    group_of: dict[str, int] = {}
    group_ids = np.zeros((s_slots,), np.int32)
    for i, (tr, (row, o)) in enumerate(zip(trajectories, placement)):
        seq = np.concatenate([np.asarray(tr.prompt_ids, np.int32), np.asarray(tr.response_ids, np.int32)])
        p, length = len(tr.prompt_ids), len(seq)
        tokens[row, o:o + length] = seq
        targets[row, o:o + length - 1] = seq[1:]
        positions[row, o:o + length] = np.arange(length)
        segment_ids[row, o:o + length] = segment_ids[row].max() + 1
        seq_ids[row, o:o + length] = i
        policy = tr.response_policy_mask()
        loss_mask[row, o + p - 1:o + length - 1] = policy
        blp[row, o + p - 1 + np.flatnonzero(policy)] = np.asarray(tr.behaviour_logprobs, np.float32)
        rewards[i] = tr.reward
        versions[i] = tr.version
        group_ids[i] = group_of.setdefault(tr.prompt_uid, len(group_of))
    group_ids[n:] = len(group_of) + np.arange(s_slots - n)  # padding slots: singleton groups (advantage 0)
    zeros = np.zeros((b, t), np.float32)
    return TrainBatch(tokens, targets, positions, segment_ids, loss_mask, blp, rewards, group_ids, versions,
                      seq_ids, zeros, zeros, zeros, zeros, zeros, zeros, zeros)


def _pack_blocks(lengths: Sequence[int], capacity: int, row_multiple: int, mini_batches: int,
                 order: Optional[Sequence[int]], rows_per_doubling: int = 1) -> tuple[list[tuple[int, int]], int]:
    """(row, offset) per trajectory and the row count B for the packed layout (see collate)."""
    if row_multiple % mini_batches:
        raise ValueError(f"row_multiple={row_multiple} must be a multiple of mini_batches={mini_batches}")
    order = np.arange(len(lengths)) if order is None else np.asarray(order)
    parts = np.array_split(order, mini_batches)
    fits = [_first_fit_decreasing([lengths[i] for i in part], capacity) for part in parts]
    used = max((max(r for r, _ in fit) + 1 if fit else 1) for fit in fits)
    unit = row_multiple // mini_batches
    per_block = unit * row_bucket(-(-used // unit), rows_per_doubling)
    placement: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for j, (part, fit) in enumerate(zip(parts, fits)):
        for i, (row, off) in zip(part, fit):
            placement[int(i)] = (j * per_block + row, off)
    return placement, per_block * mini_batches


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """(row, offset) per item: longest first, each into the first row with room (a new row if none)."""
    fill: list[int] = []
    out: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        row = next((r for r, used in enumerate(fill) if used + lengths[i] <= capacity), len(fill))
        if row == len(fill):
            fill.append(0)
        out[i] = (row, fill[row])
        fill[row] += lengths[i]
    return out


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


def token_staleness(trajectories: Sequence[Trajectory], learner_version: int) -> Staleness:
    """learner_version - the version that sampled each policy token, over every policy token of the
    batch (runtime.mode='inflight' trajectories span versions: their tokens are judged one by one;
    elsewhere every token has its trajectory's version)."""
    v = [t.policy_token_versions() for t in trajectories]
    v = np.concatenate(v) if v else np.zeros((0,), np.int32)
    return staleness(v, learner_version)


def mixed_version_frac(trajectories: Sequence[Trajectory]) -> float:
    """Share of trajectories whose policy tokens were sampled by more than one version (0 outside
    runtime.mode='inflight', where a trajectory is one version's by construction)."""
    if not trajectories:
        return 0.0
    return float(np.mean([len(np.unique(t.policy_token_versions())) > 1 for t in trajectories]))


def version_figures(versions: np.ndarray, trajectories: Sequence[Trajectory], learner_version: int) -> dict:
    """A step's staleness figures: per trajectory (its first token's version), per policy token,
    and the share of trajectories spanning versions."""
    stale, tok = staleness(versions, learner_version), token_staleness(trajectories, learner_version)
    return dict(staleness_mean=stale.mean, staleness_max=stale.max, token_staleness_mean=tok.mean,
                token_staleness_max=tok.max, mixed_version_frac=mixed_version_frac(trajectories))
