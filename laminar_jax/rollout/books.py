"""A RolloutServer's host books: which sequence each slot holds, which slots hold a shareable
prompt's KV, and the trajectories of finished sequences until step() hands them out."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

import numpy as np

from laminar_jax.rollout.records import Request
from laminar_jax.rollout.sampling import SamplingParams
from laminar_jax.types import Trajectory


@dataclasses.dataclass
class Live:
    """Host bookkeeping of one live sequence (mutable; owned by the server)."""

    request: Request
    prompt: np.ndarray  # i32[P] (after truncation)
    sampling: SamplingParams  # max_new_tokens capped by max_total_len
    key_data: np.ndarray
    version: int  # the weights generating it now (an in-flight swap moves it on)
    tokens: list
    logprobs: list
    moves: int = 0
    mask: Optional[list] = None  # multi-turn: 1 per generated token, 0 per observation token
    turn: int = 0  # index of the current policy turn
    turn_start: int = 0  # index in tokens where it began
    waiting: bool = False  # parked on its environment
    turn_end: int = 0  # policy tokens sampled when the current turn's budget runs out (the device's max_new)
    parked_at: int = 0  # the output read (count) that parked it: its slot may go once the next is read
    pages: Optional[list] = None  # KV pages held while it waits without a slot (TurnSpec.release_slot)
    resume: Optional[tuple] = None  # (observation ids, next turn's budget) waiting for a free slot
    prompt_key: Optional[bytes] = None  # set while its slot's pages hold its prompt KV for others to share
    versions: list = dataclasses.field(default_factory=list)  # the version of each policy token (as logprobs)


class SlotBooks:
    """The slots' live sequences, the prompt holders (share_prompt_kv), finished trajectories and
    the server's counts. ``engine``: whose per-slot resources a retired sequence frees."""

    def __init__(self, engine: Any, server_id: int):
        self.engine, self.server_id = engine, server_id
        self.slots: list[Optional[Live]] = [None] * engine.num_slots
        self.holders: dict[bytes, list[int]] = {}  # prompt bytes -> slots holding its KV (share_prompt_kv)
        self.finished: list[Trajectory] = []  # not yet handed out by step()
        self.counts = collections.Counter()

    def free_slots(self) -> list[int]:
        return [i for i, x in enumerate(self.slots) if x is None]

    def occupy(self, slot: int, adm: Any, version: int) -> None:
        """Host books of an admitted sequence (an admission.Admission); its prompt KV becomes
        shareable (share_prompt_kv)."""
        sp = adm.sampling
        self.slots[slot] = Live(adm.request, adm.prompt, sp, adm.key_data, version, [], [],
                                mask=[] if adm.request.turn is not None else None, turn_end=sp.max_new_tokens,
                                prompt_key=adm.prompt_key)
        if adm.prompt_key is not None:
            self.holders.setdefault(adm.prompt_key, []).append(slot)

    def vacate(self, slot: int) -> Live:
        """Empty a slot's host books (its pages are the caller's to free or keep); returns what it held."""
        live, self.slots[slot] = self.slots[slot], None
        if live.prompt_key is not None:
            holders = self.holders[live.prompt_key]
            holders.remove(slot)
            if not holders:
                del self.holders[live.prompt_key]
            live.prompt_key = None
        return live

    def retire(self, slot: int, reason: str) -> None:
        """A sequence finished in its slot: the slot and its pages go, its trajectory comes out."""
        live = self.vacate(slot)
        self.engine.free(slot)
        self.emit(live, reason)

    def emit(self, live: Live, reason: str) -> None:
        """The finished sequence's trajectory, out of the next step()."""
        self.counts["aborted" if reason == "aborted" else "completed"] += 1
        r = live.request
        extra = {"server_id": self.server_id, "moves": live.moves}
        if live.mask is not None:
            extra["turns"] = live.turn + 1
        self.finished.append(Trajectory(
            uid=r.uid, prompt_uid=r.prompt_uid, sample_index=r.sample_index, prompt_ids=live.prompt.copy(),
            response_ids=np.asarray(live.tokens, np.int32), behaviour_logprobs=np.asarray(live.logprobs, np.float32),
            version=live.versions[0] if live.versions else live.version, finish_reason=reason,
            data_source=r.data_source, ground_truth=r.ground_truth, extra=extra,
            policy_mask=None if live.mask is None else np.asarray(live.mask, np.uint8),
            token_versions=np.asarray(live.versions, np.int32)))

    def take_finished(self) -> list[Trajectory]:
        done, self.finished = self.finished, []
        return done
