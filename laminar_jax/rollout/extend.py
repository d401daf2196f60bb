"""extend(): append observation tokens to a waiting sequence, in its own KV pages; park(),
detach() and attach(): a sequence waiting on its environment, in its slot or out of it.

A multi-turn sequence stops (a stop id ends its policy turn) with ``lengths[slot] = L`` tokens
cached and its last sampled token not yet fed. The environment answers with observation ids
o_0..o_{m-1}. extend feeds ``last_token, o_0, .., o_{m-2}`` at positions L..L+m-1 over the cached
context (attention reads the slot's pages; the context is never prefilled again), writes their
KV into the slot's pages (more pages are allocated when the turn needs them), and leaves
``last_token = o_{m-1}``, so the next generate() samples the first token of the next turn through
the one sampling path. The observation is fed one token per loop iteration with the decode
step's own attention backend: observations are short (a tool result), and the decode path is
the one whose numbers the rollout already matches against the learner.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.rollout import programs as prg
from laminar_jax.rollout.attention import DecodeMeta, live_page_list
from laminar_jax.rollout.layered import layered_backend
from laminar_jax.rollout.paged import pages_needed
from laminar_jax.rollout import slot_inputs as si


def obs_bucket(m: int) -> int:
    """Padded length of the fed ids (a power of two >= m + 1, at least 16): few compiled shapes."""
    return max(16, 1 << int(m).bit_length())


def _extend_impl(spec, live_bucket: int, params, state, slot, page_row, ids, n, num_cached, last_token,
                 num_generated, max_new):
    """ids: i32[N] observation ids (padded); n: their count m >= 1; the rest from the host's books.

    The host's num_cached / last_token / num_generated are the truth: a turn ended by a host-side
    stop sequence may have decoded a token or two more on the device (pipelining); those are
    overwritten here and never attended (attention reads positions < the new length only).
    """
    model = prg.engine_model(spec, params)
    feed = jnp.concatenate([last_token[None], ids])  # token i is fed at position num_cached + i
    row = page_row[None]
    active = jnp.ones((1,), bool)

    def body(i, carry):
        k_pages, v_pages, pos = carry
        meta = DecodeMeta(row, pos[None], active, spec.page_size, kv_dtype=spec.kv_dtype)
        if live_bucket:
            meta = meta._replace(live=live_page_list(meta, live_bucket))
        backend = layered_backend(spec.kernels.attend, meta, spec.layer_pages)
        _, (k_pages, v_pages) = model.forward_cached(feed[i][None, None], pos[None, None], (k_pages, v_pages),
                                                     backend, spec.kernels.products)
        return k_pages, v_pages, pos + 1

    k_pages, v_pages, pos = jax.lax.fori_loop(0, n, body, (state.k_pages, state.v_pages, num_cached))
    return state._replace(
        k_pages=k_pages, v_pages=v_pages, page_table=state.page_table.at[slot].set(page_row),
        lengths=state.lengths.at[slot].set(pos), last_token=state.last_token.at[slot].set(feed[n]),
        num_generated=state.num_generated.at[slot].set(num_generated),
        max_new=state.max_new.at[slot].set(num_generated + max_new),
        active=state.active.at[slot].set(True))


@functools.lru_cache(maxsize=32)
def extend_program(spec, params_treedef, live_bucket: int) -> Callable:
    """Jitted extend for one engine geometry (state donated); shared by equal engines."""
    def run(leaves, state, slot, page_row, ids, n, *books):
        return _extend_impl(spec, live_bucket, jax.tree.unflatten(params_treedef, leaves), state, slot, page_row,
                            ids, n, *books)

    return jax.jit(run, donate_argnums=(1,))


def padded_ids(obs_ids: Any) -> tuple[np.ndarray, int]:
    ids = np.asarray(obs_ids, np.int32).reshape(-1)
    if len(ids) < 1:
        raise ValueError("extend: observation_ids is empty (an episode turn needs at least one token)")
    out = np.zeros((obs_bucket(len(ids)),), np.int32)
    out[:len(ids)] = ids
    return out, len(ids)


# ---------------------------------------------------------------- a waiting sequence on an engine


def park(engine, slot: int) -> None:
    """A stopped sequence waits on its environment: its pages stay, decode calls skip it."""
    if slot not in engine.page_book.slot_pages:
        raise ValueError(f"slot {slot} holds no sequence to park")
    engine.page_book.park(slot)


def detach(engine, decode_state, slot: int) -> tuple[Any, list[int]]:
    """A parked sequence gives its slot up and keeps its KV pages (returned; still allocated):
    the slot is free for another sequence, attach() puts the pages in a slot again."""
    if slot not in engine.page_book.slot_pages:
        raise ValueError(f"slot {slot} holds no sequence to detach")
    return prg.deactivate_jit(decode_state, np.int32(slot)), engine.page_book.detach(slot)


def attach(engine, decode_state, slot: int, pages: list[int], num_cached: int, last_token: int, init) -> Any:
    """Give detached pages a free slot again, with the sequence's sampling state; the slot stays
    inactive (extend() feeds the observation and activates it)."""
    engine.page_book.attach(slot, pages)
    return prg.attach_jit(decode_state, np.int32(slot), engine.page_book.page_row(slot), np.int32(num_cached),
                          np.int32(last_token), *si.init_arrays(engine.key_shape, init))


def extend(engine, params: Any, decode_state, slot: int, observation_ids, num_cached: int, last_token: int,
           num_generated: int, max_new: int) -> Any:
    """Feed a parked slot's observation over its cached context, reactivate it.

    num_cached: tokens whose KV the slot holds (prompt - 1 + response so far, the last sampled
    token excluded); last_token: that last sampled token; num_generated: policy tokens sampled so
    far (the sampling key's counter); max_new: the next turn's token budget. Pages for the
    observation and the next turn are added to the slot's own; raises ValueError past
    pages_per_seq, OutOfPages (state untouched) when the pool is short.
    """
    book = engine.page_book
    if slot not in book.slot_pages:
        raise ValueError(f"slot {slot} holds no sequence to extend")
    ids, m = padded_ids(observation_ids)
    # KV written from here: m fed now (last_token + m - 1 observation ids), the last observation
    # id fed by the next generate(), then max_new - 1 sampled tokens: num_cached + m + max_new in all.
    need = pages_needed(num_cached + m + max_new, engine.page_size)
    if need > engine.pages_per_seq:
        raise ValueError(f"extend: {num_cached + m + max_new} tokens need {need} pages, more than "
                         f"rollout.pages_per_seq={engine.pages_per_seq}")
    book.grow(slot, need)
    book.resume(slot, num_cached + m)
    leaves, _, _ = engine.bound(params)
    # One row attends at most its own pages_per_seq pages.
    program = extend_program(engine.spec, jax.tree.structure(params),
                             engine.pages_per_seq if engine.schedule.uses_live_pages else 0)
    return prg.settle(engine.spec, program(leaves, decode_state, np.int32(slot), book.page_row(slot), ids,
                                           np.int32(m), np.int32(num_cached), np.int32(last_token),
                                           np.int32(num_generated), np.int32(max_new)))
