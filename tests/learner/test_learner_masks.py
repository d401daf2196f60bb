"""Per-token policy masks with holes (multi-turn: observation tokens are context, never trained on).

The references are the unpacked path and a hole-free compaction of each trajectory.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection, collate
from laminar_jax.learner import advantages as A
from laminar_jax.learner.losses import aggregate
from laminar_jax.learner.step import trajectory_tokens
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.types import Trajectory, from_row, to_row


def test_terminal_reward_with_a_hole_packed_equals_unpacked():
    mask = jnp.asarray([[1.0, 0.0, 1.0, 0.0]])
    want = np.array([[0.0, 0.0, 1.0, 0.0]])
    np.testing.assert_array_equal(A.terminal_token_rewards(jnp.ones(1), mask), want)
    seq = jnp.asarray([[0, 0, 0, -1]])
    np.testing.assert_array_equal(A.terminal_token_rewards(jnp.ones(1), mask, seq), want)
    # Two trajectories in one row, each with a hole: one reward each, at its own last policy token.
    mask2 = jnp.asarray([[1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    seq2 = jnp.asarray([[0, 0, 0, 1, 1, 1, -1]])
    got = A.terminal_token_rewards(jnp.asarray([2.0, 3.0]), mask2, seq2)
    np.testing.assert_array_equal(got, [[0, 0, 2, 0, 0, 3, 0]])


def _episode(rng, i: int, group: int = 3) -> Trajectory:
    """A multi-turn trajectory: policy turns separated by observation tokens (mask 0)."""
    parts, mask = [], []
    for turn in range(int(rng.integers(1, 4))):
        if turn:
            obs = rng.integers(3, 100, int(rng.integers(1, 5)))
            parts.append(obs)
            mask.append(np.zeros(len(obs), np.uint8))
        act = rng.integers(3, 100, int(rng.integers(1, 7)))
        parts.append(act)
        mask.append(np.ones(len(act), np.uint8))
    resp, pm = np.concatenate(parts).astype(np.int32), np.concatenate(mask)
    prompt = rng.integers(3, 100, int(rng.integers(1, 5))).astype(np.int32)
    return Trajectory(f"p{i // group}/{i % group}", f"p{i // group}", i % group, prompt, resp,
                      rng.normal(-4.6, 0.3, int(pm.sum())).astype(np.float32), 0,
                      reward=float(rng.random()), policy_mask=pm)


def _episodes(seed: int, n: int = 9):
    rng = np.random.default_rng(seed)
    return [_episode(rng, i) for i in range(n)]


def _per_traj(batch, x, i):
    """Entries of x on trajectory i's positions (in order)."""
    return np.asarray(x)[np.asarray(batch.seq_ids) == i]


def test_collate_places_policy_tokens_and_behaviour_logprobs_only():
    trajs = _episodes(0)
    for pack in (0, 48):
        b = collate(trajs, (64,), pack_length=pack)
        for i, tr in enumerate(trajs):
            p = len(tr.prompt_ids)
            m = _per_traj(b, b.loss_mask, i)[p - 1:-1]
            np.testing.assert_array_equal(m, tr.policy_mask)
            blp = _per_traj(b, b.behaviour_logprobs, i)[p - 1:-1]
            np.testing.assert_allclose(blp[m > 0], tr.behaviour_logprobs)
            assert np.all(blp[m == 0] == 0)


def test_wrong_behaviour_count_names_the_trajectory():
    tr = _episodes(1, 1)[0]
    bad = Trajectory(tr.uid, tr.prompt_uid, 0, tr.prompt_ids, tr.response_ids,
                     np.zeros(len(tr.response_ids), np.float32), 0, reward=1.0, policy_mask=tr.policy_mask)
    if tr.num_policy_tokens == len(tr.response_ids):
        pytest.skip("episode without an observation")
    with pytest.raises(ValueError, match=r"trajectory\[0\] uid='p0/0': behaviour_logprobs has \d+ entries, "
                                         r"response_ids has \d+ policy tokens"):
        collate([bad], (64,))


def test_policy_mask_survives_the_experience_row():
    tr = _episodes(2, 1)[0]
    row = dict(to_row(tr), uid=tr.uid, prompt_uid=tr.prompt_uid, sample_index=0, prompt_ids=tr.prompt_ids,
               version=0, reward=1.0)
    np.testing.assert_array_equal(from_row(row).policy_mask, tr.policy_mask)


def _gae_compacted(r, v, gamma, lam):
    """Reference GAE over a hole-free sequence."""
    adv, nxt_v, nxt_a = np.zeros(len(r)), 0.0, 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        nxt_v, adv[t] = v[t], nxt_a
    return adv


@pytest.mark.parametrize("pack", [0, 40])
def test_gae_with_holes_equals_gae_over_policy_tokens(pack):
    trajs = _episodes(3)
    b = collate(trajs, (64,), pack_length=pack)
    mask, seq = jnp.asarray(b.loss_mask), jnp.asarray(b.seq_ids)
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.normal(size=mask.shape).astype(np.float32)) * mask
    rewards = jnp.asarray(b.rewards)
    tr_tok = A.terminal_token_rewards(rewards, mask, seq)
    adv, _ = A.gae(tr_tok, values, mask, 0.97, 0.9, seq)
    for i, tr in enumerate(trajs):
        on = _per_traj(b, mask, i) > 0
        want = _gae_compacted(_per_traj(b, tr_tok, i)[on], _per_traj(b, values, i)[on], 0.97, 0.9)
        np.testing.assert_allclose(_per_traj(b, adv, i)[on], want, rtol=1e-5, atol=1e-6)
        assert np.all(_per_traj(b, adv, i)[~on] == 0)
        assert _per_traj(b, tr_tok, i)[on][-1] == pytest.approx(tr.reward)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gae"])
def test_advantages_packed_equal_unpacked(estimator):
    trajs = _episodes(4)
    out = {}
    for pack in (0, 40):
        b = collate(trajs, (64,), pack_length=pack)
        mask, seq = jnp.asarray(b.loss_mask), jnp.asarray(b.seq_ids)
        # Values as a function of (trajectory, position): identical in both layouts.
        values = jnp.asarray(np.where(b.seq_ids >= 0, np.sin(b.seq_ids * 7.0 + b.positions), 0.0), jnp.float32)
        tr_tok = A.terminal_token_rewards(jnp.asarray(b.rewards), mask, seq)
        inp = A.AdvantageInputs(jnp.asarray(b.rewards), jnp.asarray(b.group_ids), tr_tok, values * mask, mask, seq)
        res = A.compute_advantages(estimator, inp, A.AdvantageParams(gamma=0.99, lam=0.95))
        out[pack] = [_per_traj(b, res.advantages, i) for i in range(len(trajs))]
        for i in range(len(trajs)):
            assert np.all(_per_traj(b, res.advantages, i)[_per_traj(b, mask, i) == 0] == 0)
    for i in range(len(trajs)):
        np.testing.assert_allclose(out[40][i], out[0][i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_with_holes_packed_equals_unpacked(mode):
    trajs = _episodes(5)
    got = {}
    for pack in (0, 40):
        b = collate(trajs, (64,), pack_length=pack)
        mask, seq = jnp.asarray(b.loss_mask), jnp.asarray(b.seq_ids)
        x = jnp.asarray(np.cos(b.seq_ids * 3.0 + b.positions), jnp.float32)
        st = trajectory_tokens(seq, mask, len(trajs)) if pack else None
        got[pack] = float(aggregate(x, mask, mode, seq_tokens=st))
    # Reference: per-trajectory means over policy tokens only.
    b = collate(trajs, (64,))
    xs = [np.cos(i * 3.0 + b.positions[i])[b.loss_mask[i] > 0] for i in range(len(trajs))]
    want = {"token-mean": np.concatenate(xs).mean(), "seq-mean-token-mean": np.mean([x.mean() for x in xs]),
            "seq-mean-token-sum": np.mean([x.sum() for x in xs])}[mode]
    assert got[0] == pytest.approx(want, rel=1e-5)
    assert got[40] == pytest.approx(want, rel=1e-5)


def test_packed_step_with_holes_equals_unpacked():
    base = dict(lr=1e-3, mini_batches=1, micro_batches=1, seq_len_buckets=(32, 64), seed=3,
                adv_estimator="grpo", loss_agg="seq-mean-token-mean", off_policy="tis")
    model = lambda: Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    plain = Learner(LearnerSection(**base), model())
    packed = Learner(LearnerSection(**base, pack_length=64), model())
    trajs = _episodes(6)
    m_plain, m_packed = plain.step(trajs), packed.step(trajs)
    for k in ("loss", "pg_loss", "entropy"):
        np.testing.assert_allclose(m_packed[k], m_plain[k], rtol=2e-5, atol=1e-6, err_msg=k)
