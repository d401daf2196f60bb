"""Admitting several prompts in one device call, over an engine's pool and programs.

``prefill_insert_rows`` prefills prompts packed end to end in one row (one forward, one weight
read); ``share_prompt`` admits prompts that live slots already hold by copying their KV pages. Both
reserve every sequence's pages for its whole life up front, or none (OutOfPages leaves the state
and the allocator as they were), then set the slots the way Engine.insert() does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from laminar_jax.rollout import programs as prg
from laminar_jax.rollout.paged import DecodeState, SlotInit, pages_needed
from laminar_jax.rollout.slot_inputs import init_columns, pack_prompts, page_row


def prefill_insert_rows(engine, params: Any, decode_state: DecodeState, slots: list[int], prompts: list,
                        inits: list[SlotInit]) -> DecodeState:
    """engine.prefill_insert() of several prompts (at most rollout.prefill_rows) in one call: one
    forward, one weight read.

    The prompts are packed end to end in one row, each attending only its own tokens, padded to
    the smallest of ``schedule.packed_widths`` that holds them, so the call costs about their
    tokens, not their count times the longest one's bucket (a [B, T] batch of prompts of 8-31
    tokens was ~40% padding). The KV equals the one-prompt path's to float rounding (products of
    other shapes), not bit for bit. Raises OutOfPages (state and allocator untouched) when the pool
    cannot hold them all.
    """
    if len(set(slots)) != len(slots) or any(s in engine.page_book.slot_pages for s in slots):
        raise ValueError(f"slots {slots}: must be distinct and free")
    if not (len(slots) == len(prompts) == len(inits) >= 1):
        raise ValueError(f"got {len(slots)} slots, {len(prompts)} prompts, {len(inits)} inits")
    b = engine.section.prefill_rows
    if len(slots) > b:
        raise ValueError(f"{len(slots)} prompts in one call: rollout.prefill_rows={b} at most")
    ids = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    for x in ids:
        engine.schedule.bucket_for(len(x))  # a prompt over the largest bucket is refused, as prefill_insert() does
    width = next(w for w in engine.schedule.packed_widths if w >= sum(len(x) - 1 for x in ids))
    taken = engine.page_book.reserve_all([(len(x), init.max_new) for x, init in zip(ids, inits)])
    rows, slot_ids = _claim_rows(engine, b, slots, taken, ids)
    last, cached = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    for i, x in enumerate(ids):
        last[i], cached[i] = x[-1], len(x) - 1
    leaves, progs, _ = engine.bound(params)
    return progs.prefill_insert_rows(leaves, decode_state, *pack_prompts(engine.page_size, ids, taken, width),
                                     slot_ids, rows, last, cached, *init_columns(engine.key_shape, inits, b))


def share_prompt(engine, decode_state: DecodeState, src_slots: list[int], slots: list[int], prompts: list,
                 inits: list[SlotInit]) -> DecodeState:
    """Admit prompts that other slots already hold without prefilling them again: copy each
    source's prompt KV pages into the new slot's own pages, activate the slots; one call for all.

    A GRPO group's samples share one prompt, so all but one of its prefills become page copies.
    The KV is the source's bit for bit (prefill is deterministic, so also what the slot's own
    prefill_insert() would write); the copied pages may carry the source's later tokens past the
    prompt, which the new slot never attends (its length is the prompt's) and overwrites as it
    decodes. Each source must hold its prompt with the prompt KV in place (a live single-turn
    sequence does, finished or not, until engine.free()), and be none of ``slots``. The batch
    is padded to a power of two (padding rows copy the null page onto itself and set no slot).
    Raises OutOfPages (state and allocator untouched) when the pool cannot hold them all.
    """
    if not (len(src_slots) == len(slots) == len(prompts) == len(inits) >= 1):
        raise ValueError(f"got {len(src_slots)} sources, {len(slots)} slots, {len(prompts)} prompts, "
                         f"{len(inits)} inits")
    if len(set(slots)) != len(slots) or any(s in engine.page_book.slot_pages for s in slots):
        raise ValueError(f"slots {slots}: must be distinct and free")
    for src in src_slots:
        if src not in engine.page_book.slot_pages:
            raise ValueError(f"share_prompt: source slot {src} holds no sequence")
    ids = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    longest = engine.schedule.buckets[-1]
    for x in ids:
        if not 1 <= len(x) <= longest:
            raise ValueError(f"share_prompt: prompt of {len(x)} tokens; must be in [1, {longest}]")
    b = 1 << (len(ids) - 1).bit_length()
    taken = engine.page_book.reserve_all([(len(x), init.max_new) for x, init in zip(ids, inits)])
    src, dst = np.zeros((2, b, engine.schedule.prompt_pages), np.int32)  # padding: the null page onto itself
    cached, last = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    for i, (source, x, pages) in enumerate(zip(src_slots, ids, taken)):
        m = pages_needed(len(x) - 1, engine.page_size)  # pages holding the prompt's KV (the last token is fed later)
        src[i, :m], dst[i, :m] = engine.page_book.slot_pages[source][:m], pages[:m]
        cached[i], last[i] = len(x) - 1, x[-1]
    rows, slot_ids = _claim_rows(engine, b, slots, taken, ids)
    return prg.settle(engine.spec, prg.share_prompt_jit(engine.pools, decode_state, src.reshape(-1), dst.reshape(-1),
                                                        slot_ids, rows, cached, last,
                                                        *init_columns(engine.key_shape, inits, b)))


def _claim_rows(engine, b: int, slots: list[int], taken: list[list[int]], ids: list) -> tuple[np.ndarray, np.ndarray]:
    """Give each slot its pages (prompt KV cached up to its last token); the batch's page rows
    i32[b, pages_per_seq] and slot ids i32[b], padding rows naming no slot (num_slots) and the null page."""
    rows, slot_ids = np.zeros((b, engine.pages_per_seq), np.int32), np.full((b,), engine.num_slots, np.int32)
    for i, (slot, pages, x) in enumerate(zip(slots, taken, ids)):
        rows[i], slot_ids[i] = page_row(engine.pages_per_seq, pages), slot
        engine.page_book.claim(slot, pages, len(x) - 1)
    return rows, slot_ids
