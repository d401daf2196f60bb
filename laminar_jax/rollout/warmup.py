"""Engine warm-up: compile every program a server runs before its first request.

Runs on a throwaway decode state through the engine's own calls (so the programs compiled are the
ones the server's calls hit): every prefill_insert bucket, the share_prompt batch sizes, the
export/import page copies, every packed prefill width and every generate variant (live-page
buckets, row buckets). A busy engine (no free slot or pages) compiles prefill() instead.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from laminar_jax.rollout.batch_admit import share_prompt
from laminar_jax.rollout.paged import DecodeState, SlotInit
from laminar_jax.rollout.slot_inputs import init_columns, pack_prompts


def warmup(engine, params: Any) -> None:
    """Compile every prefill_insert bucket (what the server admits with), the share_prompt batch
    sizes and every generate variant of ``engine`` now."""
    state = engine.init_decode_state()
    free_slot = next((s for s in range(engine.num_slots) if s not in engine.page_book.slot_pages), None)
    init = SlotInit(np.zeros(engine.key_shape, np.uint32), 0.0, 0, 1.0, 1, np.zeros(0, np.int32))
    shared = False  # share_prompt()'s programs serve every prompt bucket: compiled from the first
    for b in engine.schedule.buckets:
        if free_slot is None or engine.page_book.allocator.num_free < engine.schedule.reserve_pages(b, 1):
            jax.block_until_ready(engine.prefill(params, np.zeros((1, b), np.int32), 1))
            continue
        state = engine.prefill_insert(params, state, free_slot, np.zeros(b, np.int32), init)  # a b-token prompt
        if not shared:
            state, shared = _share_prompt(engine, state, free_slot, b, init)
            state = _move(engine, state, free_slot, b, init)
        state = engine.deactivate(state, free_slot)
        engine.free(free_slot)
    state = _prefill_rows(engine, params, state, init)
    bound = engine.bound(params)
    sched = engine.schedule
    n = engine.section.warmup_live_buckets or len(sched.live_buckets)
    rows = np.full((sched.num_rows,), engine.num_slots, np.int32)
    for bucket in sched.live_buckets[:n]:
        state, out = bound.generate_program(sched.num_rows)(bound.leaves, state, rows, np.int32(1), bucket)
    for small in sched.row_buckets:
        bucket = sched.row_cover(small) if sched.uses_live_pages else 0
        state, out = bound.generate_program(small)(bound.leaves, state, rows[:small], np.int32(1), bucket)
    jax.block_until_ready(out)


def _share_prompt(engine, state: DecodeState, src_slot: int, bucket: int, init: SlotInit) -> tuple[DecodeState, bool]:
    """Compile share_prompt() at every padded batch size (one program each, for every prompt)
    from src_slot's prompt, as far as free slots and pages allow; (state, compiled)."""
    b, compiled = 1, False
    while b // 2 + 1 < engine.num_slots:  # the fewest rows that pad to b, besides the source
        book = engine.page_book
        free = [s for s in range(engine.num_slots) if s not in book.slot_pages][:b // 2 + 1]
        if len(free) < b // 2 + 1 or book.allocator.num_free < len(free) * engine.schedule.reserve_pages(bucket, 1):
            break
        state = share_prompt(engine, state, [src_slot] * len(free), free, [np.zeros(bucket, np.int32)] * len(free),
                                    [init] * len(free))
        for slot in free:
            state = engine.deactivate(state, slot)
            engine.free(slot)
        b, compiled = b * 2, True
    return state, compiled


def _move(engine, state: DecodeState, slot: int, prompt_len: int, init: SlotInit) -> DecodeState:
    """Compile the export/import page copies (one program each, every sequence's pages padded to
    pages_per_seq): the first repack of a run would otherwise lower and compile them mid-tail,
    holding the GIL, on the thread that moves the sequence. slot holds a prompt_len-token prompt
    and holds it again on return."""
    num_cached = prompt_len - 1
    k, v = engine.read_slot(state, slot, num_cached)
    state = engine.deactivate(state, slot)
    engine.free(slot)
    return engine.write_slot(state, slot, k, v, num_cached, 0, prompt_len, init)


def _prefill_rows(engine, params: Any, state: DecodeState, init: SlotInit) -> DecodeState:
    """Compile prefill_insert_rows at every packed width: calls of padding alone, which write
    only the null page and no slot (so they need no free slot or page)."""
    b = engine.section.prefill_rows
    leaves, progs, _ = engine.bound(params)
    none, rows = np.full((b,), engine.num_slots, np.int32), np.zeros((b, engine.pages_per_seq), np.int32)
    for width in engine.schedule.packed_widths:
        state = progs.prefill_insert_rows(leaves, state, *pack_prompts(engine.page_size, [], [], width), none, rows,
                                          np.zeros((b,), np.int32), np.zeros((b,), np.int32),
                                          *init_columns(engine.key_shape, [init], b))
    return state
