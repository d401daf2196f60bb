"""Admission of a RolloutServer: requests checked and normalised on submit (pure), then started in
free slots by step(), each prefilled or, when a live slot holds its prompt, given a copy of that KV.

Admission policy: a request is admitted only when its pages for prompt + max_new_tokens can be
reserved up front (no preemption). If the pool is short, the request waits at the head of the
queue (FIFO) until finished sequences return pages; any request that fits in an empty pool is
accepted by submit(), so running out of pages means waiting, never a crash or deadlock.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import zlib
from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

from laminar_jax.rollout import batch_admit
from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.engine import MAX_STOP_IDS
from laminar_jax.rollout.paged import SlotInit
from laminar_jax.rollout.records import OverlongPromptError, Request
from laminar_jax.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from laminar_jax.rollout.server import RolloutServer


def _default_impl_is_threefry() -> bool:
    """Whether jax.random.key() builds threefry2x32 keys (read per call: the config can change)."""
    return str(jax.config.jax_default_prng_impl) == "threefry2x32"


@dataclasses.dataclass
class Admission:
    request: Request
    prompt: np.ndarray
    sampling: SamplingParams
    key_data: np.ndarray
    prompt_key: Optional[bytes] = None  # the prompt's bytes, when its KV may be shared (share_prompt_kv)


def prepare(req: Request, s: RolloutSection, default: SamplingParams, counts: collections.Counter) -> Admission:
    """``req`` checked against the section (overlong prompts rejected or truncated, counted in
    ``counts``) with its sampling resolved: what submit() queues."""
    prompt = np.asarray(req.prompt_ids, np.int32).reshape(-1)
    if len(prompt) == 0:
        raise ValueError(f"request {req.uid!r}: empty prompt")
    if len(prompt) > s.max_prompt_len:
        if s.overlong_prompt == "error":
            counts["rejected_overlong"] += 1
            raise OverlongPromptError(f"request {req.uid!r}: prompt has {len(prompt)} tokens > "
                                      f"rollout.max_prompt_len={s.max_prompt_len} "
                                      f"(set rollout.overlong_prompt='truncate' to keep the last tokens)")
        counts["truncated_overlong"] += 1
        prompt = prompt[-s.max_prompt_len:]
    sp = req.sampling or default
    sp.validate(f"request[{req.uid}].sampling" if req.sampling else "rollout")
    if sp.stop_token_ids is None:  # the request asks for the server's default stop ids (EOS)
        sp = dataclasses.replace(sp, stop_token_ids=default.stop_token_ids)
    if len(sp.stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"request {req.uid!r}: {len(sp.stop_token_ids)} stop ids; at most {MAX_STOP_IDS}")
    room = s.max_total_len - len(prompt)
    if req.sampling is not None and sp.max_new_tokens > room:
        raise ValueError(f"request {req.uid!r}: sampling.max_new_tokens={sp.max_new_tokens} + prompt of "
                         f"{len(prompt)} tokens exceeds rollout.max_total_len={s.max_total_len} "
                         f"(at most {room} new tokens fit)")
    # The section default (rollout.max_new_tokens) is documented as a cap: it shrinks to fit.
    sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, room))
    # Episodes extend their context past the prompt and move their pages: they neither share nor lend.
    key = prompt.tobytes() if s.share_prompt_kv and req.turn is None else None
    return Admission(req, prompt, sp, key_data(req, s.seed), key)


def key_data(req: Request, seed: int) -> np.ndarray:
    """The request's PRNG key data: its own key, its seed's, or one folded from the section's
    ``seed`` and its uid."""
    if req.key is not None:
        return np.asarray(req.key, np.uint32)
    if req.seed is not None:
        if 0 <= req.seed < 2**31 and _default_impl_is_threefry():
            # jax.random.key(seed) data for threefry2x32 is [0, seed] (either x64 mode, seeds < 2**31);
            # built here because the eager jax ops cost ~0.5 ms per request (tested against jax).
            return np.array([0, req.seed], np.uint32)
        key = jax.random.key(req.seed)
    else:
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(req.uid.encode()) & 0x7FFFFFFF)
    return np.asarray(jax.random.key_data(key), np.uint32)


def slot_init(adm: Admission) -> SlotInit:
    sp = adm.sampling
    return SlotInit(adm.key_data, sp.temperature, sp.top_k, sp.top_p, sp.max_new_tokens,
                    np.asarray(sp.stop_token_ids, np.int32))


class Admitter:
    """Starts queued requests in ``server``'s free slots (called by step() under the server's lock)."""

    def __init__(self, server: "RolloutServer"):
        self.srv = server
        self.head: Optional[Admission] = None  # popped from the queue, waiting for pages/slots

    def admit(self) -> None:
        srv = self.srv
        if srv._pending is not None:
            return  # drain the old version first (contract 1)
        if srv.section.batching == "static" and srv.num_live:
            return  # static baseline: the next batch starts when the whole batch has finished
        starts: list[tuple[int, Admission]] = []
        pages_free = srv.engine.page_book.allocator.num_free
        for slot in srv._books.free_slots():
            adm = self.head
            if adm is None:
                try:
                    adm = srv._queue.get_nowait()
                except queue.Empty:
                    break
            need = srv.engine.schedule.reserve_pages(len(adm.prompt), adm.sampling.max_new_tokens)
            if need > pages_free:
                self.head = adm  # wait (FIFO) for finished sequences to return pages
                break
            self.head = None
            pages_free -= need
            starts.append((slot, adm))
        # A prompt a live slot holds (or one prefilled just before in this pass) is copied, not prefilled.
        holders = srv._books.holders
        fresh, shared, keys = [], [], set(holders)
        for start in starts:
            key = start[1].prompt_key
            (shared if key is not None and key in keys else fresh).append(start)
            keys.add(key)
        n = srv.section.prefill_rows
        for i in range(0, len(fresh), n):
            self._start(fresh[i:i + n])
        if shared:
            srv._state = batch_admit.share_prompt(srv.engine, srv._state,
                                                  [holders[adm.prompt_key][0] for _, adm in shared],
                                                  [slot for slot, _ in shared], [adm.prompt for _, adm in shared],
                                                  [slot_init(adm) for _, adm in shared])
            srv._books.counts["prompts_shared"] += len(shared)
            for slot, adm in shared:
                srv._books.occupy(slot, adm, srv._version)

    def _start(self, starts: list[tuple[int, Admission]]) -> None:
        """Prefill and insert admissions (one engine call: one prompt, or several with prefill_rows > 1)."""
        srv = self.srv
        inits = [slot_init(adm) for _, adm in starts]
        if len(starts) == 1:
            srv._state = srv.engine.prefill_insert(srv._params, srv._state, starts[0][0], starts[0][1].prompt,
                                                   inits[0])
        else:
            srv._state = batch_admit.prefill_insert_rows(srv.engine, srv._params, srv._state,
                                                         [s for s, _ in starts], [adm.prompt for _, adm in starts],
                                                         inits)
        srv._books.counts["prompts_prefilled"] += len(starts)
        for slot, adm in starts:
            srv._books.occupy(slot, adm, srv._version)
