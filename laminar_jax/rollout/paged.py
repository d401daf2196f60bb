"""Paged KV cache: the host-side page allocator and the device-side decode state pytree."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class OutOfPages(RuntimeError):
    """The page pool cannot hold a sequence right now (callers queue; this is never a crash)."""


class PageAllocator:
    """Free list over page ids 1..num_pages-1 (page 0 is the null page: never handed out).

    Pure host bookkeeping; the device only ever sees page ids through the page table.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: must be >= 2 (page 0 is the null page)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free of {self.num_pages - 1}")
        pages = [self._free.pop() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._owned:
                raise ValueError(f"page {p} freed but not allocated (double free?)")
            self._owned.remove(p)
            self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class DecodeState(NamedTuple):
    """Everything generate() reads and writes, per slot. Immutable; updated with donation.

    A slot's cache holds the KV of its first ``lengths`` tokens; ``last_token`` (the newest prompt
    or sampled token) is fed at position ``lengths`` on the next step.
    """

    k_pages: jax.Array  # f[L * P, Hkv, D, page]: every layer's pages, layer l's from l * P (rollout/layered.py;
    v_pages: jax.Array  # f[L * P, Hkv, page, D]   layouts: rollout.attention, "pool layouts")
    page_table: jax.Array  # i32[S, pages_per_seq]; 0 = null page
    lengths: jax.Array  # i32[S]: tokens whose KV is cached
    last_token: jax.Array  # i32[S]: token fed at the next step
    num_generated: jax.Array  # i32[S]: index t of the next sampled token
    max_new: jax.Array  # i32[S]: the slot finishes when num_generated reaches it
    active: jax.Array  # bool[S]
    keys: jax.Array  # u32[S, K]: raw key data of each sequence's key_s
    temperature: jax.Array  # f32[S]
    top_k: jax.Array  # i32[S]
    top_p: jax.Array  # f32[S]
    stop_ids: jax.Array  # i32[S, max_stop]; -1 = unused


class Prefix(NamedTuple):
    """Output of prefill(): KV of prompt[:true_length-1] (padded to the bucket) and the last prompt token."""

    k: jax.Array  # f[L, T, Hkv, D]
    v: jax.Array  # f[L, T, Hkv, D]
    true_length: jax.Array  # i32[]: prompt length
    last_token: jax.Array  # i32[]: prompt[true_length - 1], fed at the first generate step


class SlotInit(NamedTuple):
    """Per-sequence values insert() writes into a slot (host numpy)."""

    key_data: np.ndarray  # u32[K]
    temperature: float
    top_k: int
    top_p: float
    max_new: int
    stop_ids: np.ndarray  # i32[max_stop]; -1 padded
    num_generated: int = 0


class StepOutput(NamedTuple):
    """What one generate() call returns to the host (k = decode steps per call)."""

    tokens: jax.Array  # i32[k, S]
    logprobs: jax.Array  # f32[k, S]
    emitted: jax.Array  # bool[k, S]: the slot was active, tokens/logprobs are real
    done: jax.Array  # bool[k, S]: this token finished the sequence (stop id or max_new)
    stopped: jax.Array  # bool[k, S]: ... by a stop id
    overflow: jax.Array  # bool[k]: more live KV pages than the engine's bucket (a bug; the server raises)
