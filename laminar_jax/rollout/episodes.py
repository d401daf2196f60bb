"""Multi-turn episodes of a RolloutServer (Request.turn).

A turn ends at a stop id (on the device), a stop sequence (on the host; the slot is deactivated)
or the turn budget; the sequence then *waits*: its slot and KV pages stay, decode skips it, and a
TurnEnd comes out of take_turns(). Its owner runs the environment elsewhere and calls
continue_episode(uid, observation_ids) (extend.extend: the observation's KV goes into the same
pages, decoding resumes) or end_episode(uid). A waiting sequence is live, so a weight swap waits
for it too: one version per trajectory across turns. With TurnSpec.release_slot a waiting episode
gives its slot up (its pages kept) and takes a free one back when its observation comes.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

from laminar_jax.rollout import extend as ext
from laminar_jax.rollout.books import Live
from laminar_jax.rollout.paged import OutOfPages, SlotInit
from laminar_jax.rollout.records import TurnEnd

if TYPE_CHECKING:
    from laminar_jax.rollout.server import RolloutServer


class Episodes:
    """The turn ends not yet taken and the episodes waiting without a slot; works on ``server``'s
    slots and decode state under the server's lock (every caller holds it)."""

    def __init__(self, server: "RolloutServer"):
        self.srv = server
        self.turns: list = []  # TurnEnds not yet taken by the owner
        self.released: dict[str, Live] = {}  # waiting episodes without a slot (TurnSpec.release_slot), by uid
        self.resume: collections.deque = collections.deque()  # uids of released episodes with their observation

    def on_token(self, slot: int, live: Live, done: bool, stopped: bool) -> None:
        """Book one generated token of an episode; end its turn at a stop id / sequence or the budget."""
        live.mask.append(1)
        if done:
            self._park(slot, "stop" if stopped else "length")
            return
        turn_ids = live.tokens[live.turn_start:]
        for seq in live.request.turn.stop_sequences:
            if len(seq) and len(turn_ids) >= len(seq) and tuple(turn_ids[-len(seq):]) == tuple(seq):
                srv = self.srv
                srv._state = srv.engine.deactivate(srv._state, slot)  # the device cannot see stop sequences
                self._park(slot, "stop")
                return

    def _room(self, live: Live) -> int:
        """Response tokens the whole-trajectory budget still allows."""
        cap = self.srv.section.max_total_len - len(live.prompt)
        if live.request.turn.max_response_tokens:
            cap = min(cap, live.request.turn.max_response_tokens)
        return cap - len(live.tokens)

    def _park(self, slot: int, reason: str) -> None:
        srv = self.srv
        live = srv._books.slots[slot]
        live.waiting = True
        live.parked_at = srv._n_consumed
        ext.park(srv.engine, slot)
        srv._books.counts["turns"] += 1
        self.turns.append(TurnEnd(live.request.uid, live.turn, np.asarray(live.tokens[live.turn_start:], np.int32),
                                  reason, len(live.tokens), self._room(live)))

    def take_turns(self) -> list:
        out, self.turns = self.turns, []
        return out

    def _waiting_slot(self, uid: str) -> int:
        for slot, live in enumerate(self.srv._books.slots):
            if live is not None and live.request.uid == uid and live.waiting:
                return slot
        raise KeyError(f"server {self.srv.section.server_id}: no episode {uid!r} waits here")

    def continue_episode(self, uid: str, observation_ids) -> bool:
        """See RolloutServer.continue_episode."""
        srv = self.srv
        obs = [int(x) for x in np.asarray(observation_ids, np.int32).reshape(-1)]
        released = self.released.get(uid)
        if released is not None and released.resume is None:
            room = self._room(released) - len(obs)
            if not obs or room < 1:
                self._end_released(uid, "length")
                return False
            released.resume = (obs, min(released.request.turn.max_new_tokens, room))
            self.resume.append(uid)  # takes a free slot at the next step (waits for one)
            return True
        srv._drain()  # its pipelined overshoot (if any) is read and dropped while it still waits
        slot = self._waiting_slot(uid)
        live = srv._books.slots[slot]
        room = self._room(live) - len(obs)
        if not obs or room < 1:
            srv._books.retire(slot, "length")
            return False
        max_new = min(live.request.turn.max_new_tokens, room)
        self._extend(slot, live, obs, max_new)
        return True

    def _extend(self, slot: int, live: Live, obs: list, max_new: int) -> None:
        """Feed the observation over the slot's cached context and start the next turn."""
        srv = self.srv
        n_gen = len(live.logprobs)
        srv._state = ext.extend(srv.engine, srv._params, srv._state, slot, obs,
                                len(live.prompt) + len(live.tokens) - 1, live.tokens[-1], n_gen, max_new)
        live.tokens.extend(obs)
        live.mask.extend([0] * len(obs))
        live.turn += 1
        live.turn_start = len(live.tokens)
        live.turn_end = n_gen + max_new
        live.waiting = False

    def release_parked(self) -> None:
        """Waiting episodes that asked for it give their slots up (pages kept), once the device
        output that may still hold a token of theirs (decoded past a host-side stop) has been read."""
        srv = self.srv
        for slot, live in enumerate(srv._books.slots):
            if (live is not None and live.waiting and live.request.turn.release_slot
                    and srv._n_consumed > live.parked_at and live.request.uid not in self.released):
                srv._state, live.pages = ext.detach(srv.engine, srv._state, slot)
                srv._books.vacate(slot)
                self.released[live.request.uid] = live

    def resume_released(self) -> None:
        """Released episodes whose observation came take free slots, first come first served."""
        srv = self.srv
        while self.resume:
            free = srv._books.free_slots()
            if not free:
                return  # waits for a slot
            uid = self.resume[0]
            live, slot = self.released[uid], free[0]
            obs, max_new = live.resume
            sp, n_gen = live.sampling, len(live.logprobs)
            init = SlotInit(live.key_data, sp.temperature, sp.top_k, sp.top_p, n_gen + max_new,
                            np.asarray(sp.stop_token_ids, np.int32), num_generated=n_gen)
            srv._state = ext.attach(srv.engine, srv._state, slot, live.pages,
                                    len(live.prompt) + len(live.tokens) - 1, live.tokens[-1], init)
            try:
                self._extend(slot, live, obs, max_new)
            except OutOfPages:
                srv._state, _ = ext.detach(srv.engine, srv._state, slot)  # the pool is short: try again next step
                return
            self.resume.popleft()
            del self.released[uid]
            live.pages, live.resume = None, None
            srv._books.slots[slot] = live

    def _end_released(self, uid: str, reason: str) -> None:
        live = self.released.pop(uid)
        if uid in self.resume:
            self.resume.remove(uid)
        self.srv.engine.page_book.allocator.free(live.pages)
        live.pages = None
        self.srv._books.emit(live, reason)

    def end_episode(self, uid: str, reason: str) -> None:
        if uid in self.released:
            self._end_released(uid, reason)
            return
        self.srv._books.retire(self._waiting_slot(uid), reason)

    def abort_released(self) -> None:
        """A forced swap: every episode waiting without a slot ends, 'aborted'."""
        for uid in list(self.released):
            self._end_released(uid, "aborted")

    def waiting_in_slots(self) -> int:
        return sum(x is not None and x.waiting for x in self.srv._books.slots)
