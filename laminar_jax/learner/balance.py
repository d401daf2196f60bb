"""Token balancing across data-parallel ranks and micro-batches (pure functions of lengths)."""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def karmarkar_karp(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Partition item indices into k bins with near-equal length sums (largest differencing method).

    Used to balance tokens across data-parallel ranks / micro-batches (AsyncFlow's
    sequence-length-balanced sampler). Each bin gets len(lengths)//k or one more items only when
    counts divide evenly; otherwise counts may differ by the greedy merge. Deterministic.
    """
    if k <= 0:
        raise ValueError(f"k={k}: must be >= 1")
    # Each heap entry is a k-tuple of (sum, items) bins sorted by sum descending; the key is the spread.
    heap = []
    for i, length in enumerate(lengths):
        bins = [(int(length), [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-int(length), i, bins))
    counter = len(lengths)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Pair a's largest with b's smallest, etc.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda x: -x[0])
        counter += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(items) for _, items in heap[0][2]]


def balanced_microbatches(token_counts: Sequence[int], num_micro: int) -> list[list[int]]:
    """Token-balanced split of rows into ``num_micro`` micro-batches of equal row count.

    Equal counts keep shapes static for the jitted step; within that constraint the token sums are
    balanced greedily (longest row to the lightest bin that still has room).
    """
    n = len(token_counts)
    if num_micro <= 0 or n % num_micro:
        raise ValueError(f"{n} rows cannot be split into {num_micro} equal micro-batches")
    cap = n // num_micro
    bins: list[list[int]] = [[] for _ in range(num_micro)]
    sums = [0] * num_micro
    for i in sorted(range(n), key=lambda i: -token_counts[i]):
        j = min((b for b in range(num_micro) if len(bins[b]) < cap), key=lambda b: (sums[b], b))
        bins[j].append(i)
        sums[j] += token_counts[i]
    return [sorted(b) for b in bins]


def balance_ranks(perm: np.ndarray, row_tokens: np.ndarray, rows: int, ranks: int) -> np.ndarray:
    """Reorder rows within each mini-batch (`rows` consecutive entries of `perm`) so that the
    `ranks` contiguous blocks the data-parallel ranks receive carry near-equal token counts (equal
    row counts, longest row to the lightest rank; learner.balance_tokens). Membership of every
    mini-batch is unchanged, so the update is the same up to summation order."""
    out = []
    for j in range(len(perm) // rows):
        idx = np.asarray(perm[j * rows:(j + 1) * rows])
        out += [idx[b] for b in balanced_microbatches(row_tokens[idx].tolist(), ranks)]
    return np.concatenate(out)


def rank_imbalance(perm: np.ndarray, row_tokens: np.ndarray, rows: int, ranks: int) -> float:
    """max / min tokens over the data-parallel ranks' blocks of each mini-batch (the worst one; 1.0 = even)."""
    worst = 1.0
    for j in range(len(perm) // rows):
        sums = row_tokens[np.asarray(perm[j * rows:(j + 1) * rows])].reshape(ranks, -1).sum(axis=1)
        worst = max(worst, float(sums.max()) / max(float(sums.min()), 1.0))
    return worst


def epoch_rows(rng: np.random.Generator, b: int, mini_batches: int, packed: bool) -> np.ndarray:
    """Row order of one epoch: mini-batch j takes rows [j b/m, (j+1) b/m) of it. Packed batches
    keep their trajectory blocks whole (blocks shuffled); unpacked rows are shuffled freely."""
    if not packed:
        return rng.permutation(b)
    per = b // mini_batches
    return np.concatenate([np.arange(j * per, (j + 1) * per) for j in rng.permutation(mini_batches)])
