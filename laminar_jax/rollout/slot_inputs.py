"""Host arrays the engine's programs take for the slots they set: pure functions of plain data.

numpy, not jnp: jit takes host values without a dispatch each.
"""

from __future__ import annotations

import numpy as np

from laminar_jax.rollout.paged import SlotInit

MAX_STOP_IDS = 8


def init_arrays(key_shape: tuple, init: SlotInit) -> tuple:
    """One slot's sampling state: (key, temperature, top_k, top_p, max_new, stop ids i32[MAX_STOP_IDS], num_generated)."""
    stop = np.full((MAX_STOP_IDS,), -1, np.int32)
    ids = np.asarray(init.stop_ids, np.int32).reshape(-1)
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_IDS} supported")
    stop[:len(ids)] = ids
    key = np.asarray(init.key_data, np.uint32).reshape(key_shape)
    return (key, np.float32(init.temperature), np.int32(init.top_k), np.float32(init.top_p),
            np.int32(init.max_new), stop, np.int32(init.num_generated))


def init_columns(key_shape: tuple, inits: list[SlotInit], b: int) -> list[np.ndarray]:
    """The inits' arrays stacked per field over b rows (padding rows repeat the first: their slot is dropped)."""
    per_row = [init_arrays(key_shape, init) for init in inits]
    per_row += [per_row[0]] * (b - len(per_row))
    return [np.stack(col) for col in zip(*per_row)]


def page_row(pages_per_seq: int, pages: list[int]) -> np.ndarray:
    """A slot's page table row: its pages, then the null page."""
    row = np.zeros((pages_per_seq,), np.int32)
    row[:len(pages)] = pages
    return row


def pack_prompts(page_size: int, ids: list, taken: list[list[int]], width: int) -> tuple[np.ndarray, ...]:
    """Packed prefill inputs, i32[width] each: every prompt's tokens but its last, end to end, as
    (token, position in its prompt, prompt index, KV page, offset in the page). Padding tokens form
    a prompt of their own (index len(ids)) whose KV goes to the null page."""
    tokens, positions, page = (np.zeros((width,), np.int32) for _ in range(3))
    segment = np.full((width,), len(ids), np.int32)
    offset = np.arange(width, dtype=np.int32) % page_size
    at = 0
    for i, (x, pages) in enumerate(zip(ids, taken)):
        p = np.arange(len(x) - 1, dtype=np.int32)
        span = slice(at, at + len(p))
        tokens[span], positions[span], segment[span] = x[:-1], p, i
        page[span], offset[span] = np.asarray(pages, np.int32)[p // page_size], p % page_size
        at += len(p)
    return tokens, positions, segment, page, offset
