"""In-flight weight swaps (runtime.mode='inflight'): a server takes a new version between two decode
calls without draining its live sequences.

Every output of the old weights is read first (RolloutServer._drain), so each token read afterwards
was sampled by the new weights and is stamped with the new version (Live.versions); the tokens
already sampled keep the version and behaviour log-prob that produced them. A sequence's KV then
follows rollout.inflight_kv:

  keep       the KV the old weights wrote stays (PipelineRL): no extra work.
  reprefill  each live sequence's KV (prompt and tokens so far) is recomputed under the new weights
             (AReaL's partial rollout) through extend.extend from position 0 over the slot's own
             pages, the decode path's numbers, so its next tokens and log-probs are exactly what the
             new weights give that context.

Either way no prompt KV cached under the old weights is shared with a new admission
(share_prompt_kv): the holders are forgotten. Callers hold the server's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from laminar_jax.rollout import extend as ext
from laminar_jax.rollout.books import Live

if TYPE_CHECKING:
    from laminar_jax.rollout.server import RolloutServer


def swap_inflight(srv: "RolloutServer", version: int, params: Any, install: Callable) -> None:
    """install(srv, version, params): the server's own weight install (rollout/server.py)."""
    srv._drain()
    install(srv, version, params)
    srv._books.holders.clear()
    lives = [x for x in srv._books.slots if x is not None] + list(srv._episodes.released.values())
    for live in lives:
        live.version, live.prompt_key = version, None
    if srv.section.inflight_kv == "reprefill":
        if srv._episodes.released:
            raise RuntimeError(f"server {srv.section.server_id}: rollout.inflight_kv='reprefill' with episodes "
                               "waiting without a slot (env.release_slot_while_waiting; refused at finalize)")
        for slot, live in enumerate(srv._books.slots):
            if live is not None:
                reprefill(srv, slot, live)


def reprefill(srv: "RolloutServer", slot: int, live: Live) -> None:
    """Recompute the KV of ``live``'s context (prompt + tokens, the last one not yet fed) under the
    server's weights, in the slot's own pages; the slot keeps its sampling state and budget. A
    waiting episode stays parked."""
    ctx = [int(x) for x in live.prompt] + [int(x) for x in live.tokens]
    if len(ctx) < 2:
        return  # one prompt token, nothing sampled: no KV is cached yet
    eng = srv.engine
    n_gen = len(live.logprobs)
    turn_end = live.turn_end if live.mask is not None else live.sampling.max_new_tokens
    left = 0 if live.waiting else max(turn_end - n_gen, 0)
    # Feeds ctx[0], ctx[1:-1] at positions 0..len-2 and leaves ctx[-1] as the next token fed: the
    # slot's state exactly as after its own prefill and decode, with the new weights' KV.
    srv._state = ext.extend(eng, srv._params, srv._state, slot, ctx[1:], 0, ctx[0], n_gen, left)
    if live.waiting:
        srv._state = eng.deactivate(srv._state, slot)
        ext.park(eng, slot)
