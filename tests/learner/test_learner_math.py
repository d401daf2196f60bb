"""Golden tests: estimators and losses vs independent NumPy references written with plain loops."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.learner import advantages as A
from laminar_jax.learner import losses as L
from laminar_jax.learner.batch import collate, bucket_length, staleness
from laminar_jax.types import Trajectory

TOL = dict(rtol=1e-5, atol=1e-6)


def _masks():
    # rows: normal (prompt 2, response 5), length-1 response, fully masked, response up to the end
    m = np.zeros((4, 8), np.float32)
    m[0, 1:6] = 1
    m[1, 3] = 1
    m[3, 4:8] = 1
    return m


# ------------------------------------------------------------------------------------ references
def ref_gae(r, v, m, gamma, lam):
    b, t = r.shape
    adv = np.zeros((b, t))
    for i in range(b):
        idx = [j for j in range(t) if m[i, j] > 0]
        next_v, next_a = 0.0, 0.0
        for j in reversed(idx):
            delta = r[i, j] + gamma * next_v - v[i, j]
            a = delta + gamma * lam * next_a
            adv[i, j] = a
            next_v, next_a = v[i, j], a
    ret = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if m[i, j] > 0:
                ret[i, j] = adv[i, j] + v[i, j]
    return adv, ret


def ref_group_adv(rewards, groups, kind, norm_by_std=True, eps=1e-6):
    out = []
    for i in range(len(rewards)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        if kind == "rloo":
            out.append(rewards[i] - (sum(members) - rewards[i]) / (n - 1))
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((rewards[i] - mean) / (std + eps) if norm_by_std else rewards[i] - mean)
    return np.array(out)


def ref_ppo(logp, logp_old, adv, eps_lo, eps_hi, c):
    out = np.zeros(logp.shape)
    for idx in np.ndindex(logp.shape):
        ratio = math.exp(logp[idx] - logp_old[idx])
        a = adv[idx]
        clipped_ratio = min(max(ratio, 1 - eps_lo), 1 + eps_hi)
        loss = max(-a * ratio, -a * clipped_ratio)
        if c is not None and a < 0:
            loss = min(loss, -c * a)
        out[idx] = loss
    return out


def ref_agg(x, m, mode):
    b, t = x.shape
    if mode == "token-mean":
        num = sum(x[i, j] * m[i, j] for i in range(b) for j in range(t))
        den = sum(m[i, j] for i in range(b) for j in range(t))
        return num / max(den, 1)
    per_seq = []
    for i in range(b):
        cnt = sum(m[i])
        if cnt == 0:
            continue
        s = sum(x[i, j] * m[i, j] for j in range(t))
        per_seq.append(s / cnt if mode == "seq-mean-token-mean" else s)
    return sum(per_seq) / max(len(per_seq), 1)


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop_reference(gamma, lam):
    rng = np.random.default_rng(0)
    m = _masks()
    r = rng.normal(size=m.shape).astype(np.float32) * m
    v = rng.normal(size=m.shape).astype(np.float32)
    adv, ret = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma, lam)
    ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, **TOL)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, **TOL)
    assert np.all(np.asarray(adv)[2] == 0)  # fully masked row


def test_gae_terminal_reward_with_kl_penalty_and_whitening():
    rng = np.random.default_rng(1)
    m = _masks()
    rewards = np.array([1.0, -0.5, 3.0, 0.25], np.float32)
    kl = rng.uniform(0, 1, m.shape).astype(np.float32)
    v = rng.normal(size=m.shape).astype(np.float32)
    tr = A.terminal_token_rewards(jnp.asarray(rewards), jnp.asarray(m)) - 0.1 * jnp.asarray(kl * m)
    ref_tr = np.zeros(m.shape)
    for i in range(m.shape[0]):
        last = max([j for j in range(m.shape[1]) if m[i, j] > 0], default=None)
        for j in range(m.shape[1]):
            ref_tr[i, j] = -0.1 * kl[i, j] * m[i, j]
        if last is not None:
            ref_tr[i, last] += rewards[i]
    np.testing.assert_allclose(np.asarray(tr), ref_tr, **TOL)
    out = A.compute_advantages("gae", A.AdvantageInputs(jnp.asarray(rewards), jnp.zeros(4, jnp.int32), tr,
                                                        jnp.asarray(v), jnp.asarray(m)),
                               A.AdvantageParams(gamma=1.0, lam=0.95, whiten=True))
    ref_adv, _ = ref_gae(ref_tr, v, m, 1.0, 0.95)
    vals = [ref_adv[i, j] for i in range(4) for j in range(8) if m[i, j] > 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / len(vals))
    for i in range(4):
        for j in range(8):
            want = (ref_adv[i, j] - mean) / (std + 1e-6) if m[i, j] > 0 else 0.0
            assert abs(float(out.advantages[i, j]) - want) < 1e-4


@pytest.mark.parametrize("kind,norm", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_advantages_match_loop_reference(kind, norm):
    rng = np.random.default_rng(2)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3], np.int32)  # group 2 is a singleton
    rewards = rng.normal(size=len(groups)).astype(np.float32)
    rewards[9:12] = 0.7  # all-equal group
    got = A.grpo(jnp.asarray(rewards), jnp.asarray(groups), norm, 1e-6) if kind == "grpo" else \
        A.rloo(jnp.asarray(rewards), jnp.asarray(groups))
    want = ref_group_adv(rewards, groups, kind, norm)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(got)[9:12] == 0) and float(got[8]) == 0.0


def test_group_advantage_broadcast_respects_mask():
    m = _masks()
    out = A.compute_advantages("grpo", A.AdvantageInputs(jnp.asarray([1.0, 0.0, 5.0, 0.0]),
                                                         jnp.asarray([0, 0, 0, 0]), None, None, jnp.asarray(m)),
                               A.AdvantageParams())
    want = ref_group_adv([1.0, 0.0, 5.0, 0.0], [0, 0, 0, 0], "grpo")
    np.testing.assert_allclose(np.asarray(out.advantages), want[:, None] * m, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="adv_estimator"):
        A.compute_advantages("nope", out, A.AdvantageParams())


@pytest.mark.parametrize("eps_lo,eps_hi,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)])
def test_ppo_clip_loss_matches_reference(eps_lo, eps_hi, c):
    rng = np.random.default_rng(3)
    shape = (3, 7)
    logp = rng.normal(-2, 1, shape).astype(np.float32)
    logp_old = logp + rng.normal(0, 0.6, shape).astype(np.float32)
    adv = rng.normal(0, 2, shape).astype(np.float32)
    out = L.ppo_clip_loss(jnp.asarray(logp), jnp.asarray(logp_old), jnp.asarray(adv), eps_lo, eps_hi, c)
    np.testing.assert_allclose(np.asarray(out.loss), ref_ppo(logp, logp_old, adv, eps_lo, eps_hi, c), **TOL)
    if c is not None:
        assert float(out.dual_clipped.sum()) > 0  # the case is exercised


def test_value_loss_matches_reference():
    rng = np.random.default_rng(4)
    v, vo, ret = (rng.normal(size=(2, 5)).astype(np.float32) for _ in range(3))
    got, _ = L.value_loss(jnp.asarray(v), jnp.asarray(vo), jnp.asarray(ret), 0.2)
    got_nc, _ = L.value_loss(jnp.asarray(v), jnp.asarray(vo), jnp.asarray(ret), None)
    for idx in np.ndindex(v.shape):
        vc = vo[idx] + min(max(v[idx] - vo[idx], -0.2), 0.2)
        want = 0.5 * max((v[idx] - ret[idx]) ** 2, (vc - ret[idx]) ** 2)
        assert abs(float(got[idx]) - want) < 1e-5
        assert abs(float(got_nc[idx]) - 0.5 * (v[idx] - ret[idx]) ** 2) < 1e-5


def test_entropy_and_kl_estimators():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, (2, 3, 11)).astype(np.float32)
    got = np.asarray(L.entropy_from_logits(jnp.asarray(logits)))
    for idx in np.ndindex(logits.shape[:2]):
        z = logits[idx]
        zmax = max(z)
        p = [math.exp(x - zmax) for x in z]
        s = sum(p)
        h = -sum((pi / s) * math.log(pi / s) for pi in p)
        assert abs(got[idx] - h) < 1e-5
    lp, lr = rng.normal(-1, 1, (4,)).astype(np.float32), rng.normal(-1, 1, (4,)).astype(np.float32)
    for name, f in {"k1": lambda a, b: a - b, "k2": lambda a, b: 0.5 * (a - b) ** 2,
                    "k3": lambda a, b: math.exp(b - a) - 1 - (b - a)}.items():
        got = np.asarray(L.kl_penalty(name, jnp.asarray(lp), jnp.asarray(lr)))
        np.testing.assert_allclose(got, [f(a, b) for a, b in zip(lp, lr)], **TOL)
    assert np.all(np.asarray(L.kl_k3(jnp.asarray(lp), jnp.asarray(lr))) >= 0)


def test_k3_is_clamped_to_ten_at_the_extremes_and_its_gradient_vanishes_there():
    import jax

    # logp = -3, logp_ref = 0: unclamped k3 = e^3 - 1 - 3 = 16.09; clamped to 10.
    assert float(L.kl_k3(jnp.asarray(-3.0), jnp.asarray(0.0))) == pytest.approx(10.0)
    # pi_ref << pi: k3 grows like |d| (e^-d -> 0): 30 -> 10 after the clamp.
    assert float(L.kl_k3(jnp.asarray(0.0), jnp.asarray(-30.0))) == pytest.approx(10.0)
    # Inside the clamp it is the exact estimator.
    assert float(L.kl_k3(jnp.asarray(-1.0), jnp.asarray(0.0))) == pytest.approx(math.e - 2.0, rel=1e-6)
    # pi_ref >> pi: the unclamped gradient 1 - pi_ref/pi would be -e^20; it is 0 past the clamp.
    g = jax.grad(lambda lp: L.kl_k3(lp, jnp.asarray(0.0)))(jnp.asarray(-20.0))
    assert float(g) == 0.0
    g_in = jax.grad(lambda lp: L.kl_k3(lp, jnp.asarray(0.0)))(jnp.asarray(-1.0))
    assert float(g_in) == pytest.approx(1.0 - math.e, rel=1e-5)
    lp = jnp.asarray([-50.0, -3.0, 0.0, 3.0, 50.0])
    k = np.asarray(L.kl_k3(lp, jnp.zeros_like(lp)))
    assert np.all((k >= 0) & (k <= 10.0)) and np.all(np.isfinite(k))


def test_value_clip_does_not_count_round_off_as_clipped():
    # v_old + (v - v_old) != v in float32 for this case; v is 0.18 inside [-0.16, 0.24].
    v, vo = jnp.asarray([-0.14], jnp.float32), jnp.asarray([0.04], jnp.float32)
    for ret in (-1.0, 0.0, 1.0):
        _, clipped = L.value_loss(v, vo, jnp.asarray([ret], jnp.float32), 0.2)
        assert float(clipped[0]) == 0.0
    # Outside the range it is clipped, and the clipped branch is taken when it is the larger loss.
    loss, clipped = L.value_loss(jnp.asarray([0.5]), jnp.asarray([0.0]), jnp.asarray([1.0]), 0.2)
    assert float(clipped[0]) == 1.0 and float(loss[0]) == pytest.approx(0.5 * 0.8 ** 2)


def test_groups_of_one_are_rejected_at_finalize_for_grpo_and_rloo():
    from laminar_jax.config import ConfigError, default_config, finalize

    for est in ("grpo", "rloo"):
        cd = default_config()
        cd.learner.adv_estimator = est
        cd.runtime.samples_per_prompt = 1
        with pytest.raises(ConfigError, match="runtime.samples_per_prompt"):
            finalize(cd)
    cd = default_config()
    cd.learner.adv_estimator, cd.learner.critic, cd.runtime.samples_per_prompt = "gae", "separate", 1
    try:
        finalize(cd)
    except ConfigError as e:  # GAE with one sample per prompt is fine as far as groups go
        assert "samples_per_prompt" not in str(e)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_and_micro_batch_additivity(mode):
    rng = np.random.default_rng(6)
    m = _masks()
    x = rng.normal(size=m.shape).astype(np.float32)
    got = float(L.aggregate(jnp.asarray(x), jnp.asarray(m), mode))
    assert abs(got - ref_agg(x, m, mode)) < 1e-5
    norm = L.agg_norm(jnp.asarray(m))
    parts = sum(float(L.aggregate(jnp.asarray(x[i:i + 2]), jnp.asarray(m[i:i + 2]), mode, norm)) for i in (0, 2))
    assert abs(parts - got) < 1e-5
    assert float(L.aggregate(jnp.asarray(x), jnp.zeros_like(jnp.asarray(m)), mode)) == 0.0


def test_off_policy_corrections():
    rng = np.random.default_rng(7)
    prox = rng.normal(-1, 1, (3, 4)).astype(np.float32)
    behav = prox + rng.normal(0, 1.0, (3, 4)).astype(np.float32)
    cap = 1.5
    none = L.off_policy_correction("none", jnp.asarray(prox), jnp.asarray(behav), cap)
    np.testing.assert_array_equal(np.asarray(none.logp_old), behav)
    assert np.all(np.asarray(none.weight) == 1)
    tis = L.off_policy_correction("tis", jnp.asarray(prox), jnp.asarray(behav), cap)
    dec = L.off_policy_correction("decoupled", jnp.asarray(prox), jnp.asarray(behav), cap)
    np.testing.assert_array_equal(np.asarray(tis.logp_old), prox)
    np.testing.assert_array_equal(np.asarray(dec.logp_old), prox)
    for idx in np.ndindex(prox.shape):
        w = math.exp(prox[idx] - behav[idx])
        assert abs(float(tis.weight[idx]) - min(w, cap)) < 1e-5
        assert abs(float(dec.weight[idx]) - (w if w <= cap else 0.0)) < 1e-5


def _traj(uid, prompt, response, version=0, reward=1.0, group="p0"):
    return Trajectory(uid=uid, prompt_uid=group, sample_index=0, prompt_ids=np.array(prompt, np.int32),
                      response_ids=np.array(response, np.int32),
                      behaviour_logprobs=-np.arange(1, len(response) + 1, dtype=np.float32) / 10,
                      version=version, reward=reward)


def test_collate_shift_padding_and_groups():
    trs = [_traj("a/0", [1, 5, 6], [7, 8, 2], version=3, group="a"),
           _traj("b/0", [1], [9], version=1, reward=0.0, group="b"),
           _traj("a/1", [1, 5, 6], [], version=2, group="a")]
    b = collate(trs, buckets=(4, 8, 16), row_multiple=4)
    assert b.tokens.shape == (4, 8)
    for i, tr in enumerate(trs):
        seq = list(tr.prompt_ids) + list(tr.response_ids)
        p = len(tr.prompt_ids)
        for t in range(8):
            assert b.tokens[i, t] == (seq[t] if t < len(seq) else 0)
            assert b.targets[i, t] == (seq[t + 1] if t + 1 < len(seq) else 0)
            in_resp = p <= t + 1 < len(seq)
            assert b.loss_mask[i, t] == (1.0 if in_resp else 0.0)
            if in_resp:  # the behaviour log-prob of token t+1 sits at position t
                assert b.behaviour_logprobs[i, t] == tr.behaviour_logprobs[t + 1 - p]
    assert b.loss_mask[3].sum() == 0 and b.segment_ids[3].sum() == 0
    assert list(b.group_ids) == [0, 1, 0, 2]
    assert list(b.versions) == [3, 1, 2, -1]
    s = staleness(b.versions, 4)
    assert (s.mean, s.max, s.min) == (2.0, 3, 1)


def test_collate_errors_name_the_trajectory():
    with pytest.raises(ValueError, match="uid='x/0'.*reward is None"):
        collate([_traj("x/0", [1], [2], reward=None)], buckets=(8,))
    with pytest.raises(ValueError, match="uid='y/0'.*exceeds"):
        collate([_traj("y/0", [1] * 5, [2] * 5)], buckets=(4, 8))
    bad = _traj("z/0", [1], [2, 3])
    bad = Trajectory(**{**bad.__dict__, "behaviour_logprobs": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="uid='z/0'.*behaviour_logprobs"):
        collate([bad], buckets=(8,))
    assert bucket_length(5, (4, 8)) == 8
