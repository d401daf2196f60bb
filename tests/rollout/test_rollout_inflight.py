"""In-flight weight swaps on one server (rollout/inflight.py): live sequences go on under the new
version, each token stamped with the version that sampled it; 'keep' goes on over the old KV,
'reprefill' recomputes it, so its later log-probs are what a fresh forward of the new weights gives."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.model import token_logprobs
from laminar_jax.rollout.records import SequenceState
from tests.rollout.rollout_helpers import SECTION, make_server, params_of, request, run_until, tiny_model

N, MAX_NEW, BEFORE = 3, 20, 6


def _fresh_logprobs(model, traj) -> np.ndarray:
    """Log-probs of the response under one training forward of ``model`` (temperature 1)."""
    p, r = list(traj.prompt_ids), list(traj.response_ids)
    logits = model.forward(jnp.asarray([p + r], jnp.int32)).logits
    return np.asarray(token_logprobs(logits[0, len(p) - 1:len(p) + len(r) - 1], jnp.asarray(r), 1.0))


def _run(kv: str, inflight: bool = True) -> dict:
    srv = make_server(dataclasses.replace(SECTION, inflight_kv=kv))
    for i in range(N):
        srv.submit(request(i, max_new=MAX_NEW))
    out = {}
    for _ in range(BEFORE):
        out.update({t.uid: t for t in srv.step()})
    assert srv.num_live == N and not out
    srv.set_params(1, params_of(1), inflight=inflight)
    out.update(run_until(srv, N))
    srv.step()  # a drained swap happens at the step after the last sequence finished
    assert srv.version == 1
    return out


@pytest.fixture(scope="module")
def runs():
    return {kv: _run(kv) for kv in ("keep", "reprefill")}


def test_tokens_carry_their_versions(runs):
    for trajs in runs.values():
        for t in trajs.values():
            v = t.token_versions
            assert len(v) == len(t.behaviour_logprobs) == MAX_NEW
            k = int((v == 0).sum())
            assert 0 < k < MAX_NEW and (v[:k] == 0).all() and (v[k:] == 1).all(), v
            assert t.version == 0  # the oldest: trajectory-level staleness is judged on it


def test_reprefill_logprobs_equal_a_fresh_forward_of_the_new_weights(runs):
    old, new = tiny_model(0), tiny_model(1)
    gaps = {}
    for kv, trajs in runs.items():
        gaps[kv] = 0.0
        for t in trajs.values():
            after = t.token_versions == 1
            lp = np.asarray(t.behaviour_logprobs)
            # Tokens sampled before the swap: the old weights' log-probs, in both modes.
            np.testing.assert_allclose(lp[~after], _fresh_logprobs(old, t)[~after], atol=1e-4)
            gaps[kv] = max(gaps[kv], float(np.abs(lp[after] - _fresh_logprobs(new, t)[after]).max()))
    assert gaps["reprefill"] < 1e-4, gaps
    # keep samples the new weights over the old weights' KV: its log-probs are its own, not a fresh
    # forward's (so the assertion above is one that can fail).
    assert gaps["keep"] > 1e-3, gaps


def test_a_drained_swap_keeps_one_version_per_trajectory():
    trajs = _run("keep", inflight=False)
    for t in trajs.values():
        assert t.version == 0 and (t.token_versions == 0).all()


def test_moves_carry_token_versions():
    srv = make_server()
    srv.submit(request(0, max_new=MAX_NEW))
    for _ in range(BEFORE):
        srv.step()
    srv.set_params(1, params_of(1), inflight=True)
    for _ in range(3):
        srv.step()
    (slot, uid, _), = srv.live_sequences()
    state = SequenceState.from_bytes(srv.export_sequence(slot).to_bytes())
    vs = state.versions_list()
    assert state.version == 1 and vs[0] == 0 and vs[-1] == 1 and len(vs) == len(state.logprobs)
    dst = make_server(version=1)
    dst.import_sequence(state)
    t = run_until(dst, 1)[uid]
    assert t.token_versions.tolist()[:len(vs)] == vs and (t.token_versions[len(vs):] == 1).all()
    assert t.version == 0


@pytest.mark.parametrize("kv", ["keep", "reprefill"])
def test_episode_waiting_at_a_swap_goes_on_under_the_new_version(kv):
    """A multi-turn episode parked on its environment when the swap comes: its next turn is the new
    version's; with 'reprefill' its whole context (observation included) is the new weights' KV."""
    from tests.rollout.test_rollout_episodes import OBS, PROMPT, SECTION as EP_SECTION, _req, _until_done, _until_turn
    from laminar_jax.rollout.records import TurnSpec
    from laminar_jax.rollout import RolloutServer, make_engine

    engine, params = make_engine(tiny_model(0), dataclasses.replace(EP_SECTION, inflight_kv=kv))
    srv = RolloutServer(engine, params, 0)
    srv.submit(_req("e/0", PROMPT, 5, TurnSpec(max_new_tokens=6)))
    _until_turn(srv)
    srv.set_params(1, params_of(1), inflight=True)
    srv.step()  # the swap, while the episode waits in its slot
    assert srv.version == 1 and srv.num_waiting() == 1
    assert srv.continue_episode("e/0", OBS)
    _until_turn(srv)
    srv.end_episode("e/0")
    (t,) = _until_done(srv)
    assert t.token_versions.tolist() == [0] * 5 + [1] * 6 and t.version == 0
    pos = np.flatnonzero(t.policy_mask)[5:]  # the second turn's tokens in the response
    gap = np.abs(np.asarray(t.behaviour_logprobs)[5:] - _fresh_logprobs(tiny_model(1), t)[pos]).max()
    assert (gap < 1e-4) if kv == "reprefill" else (gap > 1e-3), gap
