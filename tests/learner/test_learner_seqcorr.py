"""Sequence-level corrections (learner/losses_seq.py) against NumPy references written from the
formulas: GSPO's objective (arXiv:2507.18071, eq. 5-7) and verl's sequence-level importance weights
(rollout_corr_helper: product of token ratios for rollout_is='sequence', truncated from above;
seq_sum_k1 / seq_mean_k1 rejection bands), on random inputs with padding masks, one trajectory per
row (verl's layout) and several packed in a row (ours)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.configlib import ConfigError
from laminar_jax.learner import LearnerSection
from laminar_jax.learner import losses as L
from laminar_jax.learner import losses_seq as S

TOL = dict(rtol=2e-5, atol=2e-6)


def _rows(rng, b=6, t=12):
    """Random per-token inputs, one trajectory per row: prompt 1-3 tokens, responses of random length
    (one row fully masked, one with a multi-turn hole), segment id 1 on real tokens."""
    mask = np.zeros((b, t), np.float32)
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        p = int(rng.integers(1, 4))
        n = 0 if i == 2 else int(rng.integers(1, t - p))
        seg[i, :p + n + 1] = 1
        mask[i, p:p + n] = 1
    mask[4, 5] = 0  # an observation token inside a multi-turn response (if it was on)
    f = lambda scale: rng.normal(0, scale, (b, t)).astype(np.float32)
    logp = -np.abs(f(1.0)) - 0.1
    return dict(mask=mask, seg=seg, logp=logp, old=logp + f(0.05), prox=logp + f(0.05), behav=logp + f(0.1))


# ------------------------------------------------------------------------------------ references
def ref_seq_log_ratio(num, den, mask, how):
    """Per row (= sequence): masked sum of token log ratios ('product') or masked mean ('geometric')."""
    s = ((num - den) * mask).sum(-1)
    if how == "geometric":
        s = s / np.maximum(mask.sum(-1), 1.0)
    return s


def ref_seq_weights(prox, behav, mask, how, name, low, high):
    log_rho = np.clip(ref_seq_log_ratio(prox.astype(np.float64), behav, mask, how), -20, 20)
    rho = np.exp(log_rho)
    if name == "seq_tis":
        w, flagged = np.minimum(rho, high), rho > high
    else:
        flagged = (rho < low) | (rho > high)
        w = np.where(flagged, 0.0, 1.0)
    return w[:, None] * mask, flagged


def ref_gspo_objective(logp, old, adv_seq, mask, eps_low, eps_high):
    """-J of GSPO: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i) over sequences with a response token."""
    s = np.exp(ref_seq_log_ratio(logp, old, mask, "geometric"))
    per_seq = np.minimum(s * adv_seq, np.clip(s, 1 - eps_low, 1 + eps_high) * adv_seq)
    live = mask.sum(-1) > 0
    return -per_seq[live].sum() / live.sum()


def ref_gspo_grad(logp, old, adv_seq, mask, eps_low, eps_high, h=1e-5):
    """d(-J)/d logp by central differences of the float64 objective, response tokens only."""
    logp = logp.astype(np.float64)
    g = np.zeros_like(logp)
    for idx in zip(*np.nonzero(mask)):
        up, dn = logp.copy(), logp.copy()
        up[idx] += h
        dn[idx] -= h
        g[idx] = (ref_gspo_objective(up, old, adv_seq, mask, eps_low, eps_high)
                  - ref_gspo_objective(dn, old, adv_seq, mask, eps_low, eps_high)) / (2 * h)
    return g


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("how", ["product", "geometric"])
@pytest.mark.parametrize("name", ["seq_tis", "seq_mask"])
def test_sequence_is_weights_match_reference(name, how):
    rng = np.random.default_rng(11)
    d = _rows(rng)
    # A band that some sequences leave on each side and others stay in (geometric ratios sit near 1).
    high, low = (1.3, 0.8) if how == "product" else (1.02, 0.98)
    got = S.seq_correction(name, jnp.asarray(d["prox"]), jnp.asarray(d["behav"]), jnp.asarray(d["mask"]),
                           jnp.asarray(d["seg"]), S.SeqBand(how, high, low))
    w, flagged = ref_seq_weights(d["prox"], d["behav"], d["mask"], how, name, low, high)
    np.testing.assert_allclose(np.asarray(got.out.weight), w, **TOL)
    np.testing.assert_array_equal(np.asarray(got.out.logp_old), d["prox"])
    np.testing.assert_array_equal(np.asarray(got.flagged), flagged[:, None] * d["mask"])
    live = d["mask"].sum(-1) > 0
    assert 0 < flagged[live].sum() < live.sum(), "the band should cap/drop some sequences and keep others"


def test_sequence_weights_have_no_gradient_and_product_is_not_geometric():
    rng = np.random.default_rng(3)
    d = _rows(rng)
    args = (jnp.asarray(d["behav"]), jnp.asarray(d["mask"]), jnp.asarray(d["seg"]), S.SeqBand("product", 1.5, 0.5))
    g = jax.grad(lambda p: S.seq_correction("seq_tis", p, *args).out.weight.sum())(jnp.asarray(d["prox"]))
    assert float(jnp.abs(g).max()) == 0.0
    prod = S.seq_log_ratio(jnp.asarray(d["prox"]), *args[:3], "product")
    geo = S.seq_log_ratio(jnp.asarray(d["prox"]), *args[:3], "geometric")
    n = d["mask"].sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(geo) * n, np.asarray(prod), **TOL)


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.0003, 0.0004)])  # GSPO's paper: 3e-4 / 4e-4
def test_gspo_loss_and_gradient_match_the_sequence_objective(eps_low, eps_high):
    rng = np.random.default_rng(5)
    d = _rows(rng)
    adv_seq = rng.normal(size=d["mask"].shape[0]).astype(np.float32)
    adv = adv_seq[:, None] * d["mask"]
    mask = jnp.asarray(d["mask"])

    def loss(logp):
        pg = S.gspo_clip_loss(logp, jnp.asarray(d["old"]), jnp.asarray(adv), mask, jnp.asarray(d["seg"]),
                              eps_low, eps_high)
        return L.aggregate(pg.loss, mask, "seq-mean-token-mean")

    value, grad = jax.value_and_grad(loss)(jnp.asarray(d["logp"]))
    ref = ref_gspo_objective(d["logp"].astype(np.float64), d["old"], adv_seq, d["mask"], eps_low, eps_high)
    assert abs(float(value) - ref) < 1e-5
    ref_g = ref_gspo_grad(d["logp"], d["old"], adv_seq, d["mask"], eps_low, eps_high)
    np.testing.assert_allclose(np.asarray(grad), ref_g, rtol=1e-3, atol=1e-6)
    if eps_high < 1e-3:  # the tight band clips some sequences: their gradient is 0, the others' is not
        s = np.exp(ref_seq_log_ratio(d["logp"], d["old"], d["mask"], "geometric"))
        clipped = ((adv_seq > 0) & (s > 1 + eps_high)) | ((adv_seq < 0) & (s < 1 - eps_low))
        live = d["mask"].sum(-1) > 0
        assert clipped[live].any() and (~clipped[live]).any()
        assert np.all(np.asarray(grad)[clipped] == 0)


def test_gspo_equals_token_ppo_when_every_sequence_has_one_token():
    rng = np.random.default_rng(2)
    b, t = 5, 4
    mask = np.zeros((b, t), np.float32)
    mask[:, 2] = 1
    seg = np.ones((b, t), np.int32)
    logp, old, adv = (rng.normal(-1, 0.3, (b, t)).astype(np.float32) for _ in range(3))
    a = S.gspo_clip_loss(*map(jnp.asarray, (logp, old, adv, mask, seg)), 0.2, 0.28)
    p = L.ppo_clip_loss(*map(jnp.asarray, (logp, old, adv)), 0.2, 0.28)
    np.testing.assert_allclose(np.asarray(a.loss) * mask, np.asarray(p.loss) * mask, **TOL)


def _pack(d, rows_per_pack=2):
    """Rows (one trajectory each) laid end to end, two to a packed row, segment ids 1, 2."""
    b, t = d["mask"].shape
    out = {k: np.zeros((b // rows_per_pack, t * rows_per_pack), v.dtype) for k, v in d.items()}
    for i in range(b):
        r, j = divmod(i, rows_per_pack)
        for k, v in d.items():
            out[k][r, j * t:(j + 1) * t] = v[i] if k != "seg" else v[i] * (j + 1)
    return out


@pytest.mark.parametrize("name", ["seq_tis", "seq_mask"])
def test_packed_rows_give_each_trajectory_its_own_ratio(name):
    rng = np.random.default_rng(9)
    d = _rows(rng)
    band = S.SeqBand("product", 1.3, 0.8)
    flat = S.seq_correction(name, *(jnp.asarray(d[k]) for k in ("prox", "behav", "mask", "seg")), band)
    p = _pack(d)
    packed = S.seq_correction(name, *(jnp.asarray(p[k]) for k in ("prox", "behav", "mask", "seg")), band)
    b, t = d["mask"].shape
    np.testing.assert_allclose(np.asarray(packed.out.weight).reshape(b, t), np.asarray(flat.out.weight), **TOL)
    adv = (rng.normal(size=b)[:, None] * d["mask"]).astype(np.float32)
    g_flat = S.gspo_clip_loss(*(jnp.asarray(d[k]) for k in ("logp", "old")), jnp.asarray(adv),
                              jnp.asarray(d["mask"]), jnp.asarray(d["seg"]), 0.2, 0.2)
    g_packed = S.gspo_clip_loss(*(jnp.asarray(p[k]) for k in ("logp", "old")), jnp.asarray(adv.reshape(b // 2, -1)),
                                jnp.asarray(p["mask"]), jnp.asarray(p["seg"]), 0.2, 0.2)
    np.testing.assert_allclose(np.asarray(g_packed.loss).reshape(b, t) * d["mask"],
                               np.asarray(g_flat.loss) * d["mask"], **TOL)


def test_defaults_keep_token_level_ppo_and_no_correction():
    s = LearnerSection()
    assert (s.ratio_level, s.off_policy, s.dynamic_sampling) == ("token", "none", False)
    rng = np.random.default_rng(1)
    d = _rows(rng)
    args = [jnp.asarray(d[k]) for k in ("logp", "old")]
    adv = jnp.asarray(rng.normal(size=d["mask"].shape).astype(np.float32))
    a = S.policy_loss(s, *args, adv, jnp.asarray(d["mask"]), jnp.asarray(d["seg"]))
    b = L.ppo_clip_loss(*args, adv, s.clip_eps_low, s.clip_eps_high, s.dual_clip_c)
    np.testing.assert_array_equal(np.asarray(a.loss), np.asarray(b.loss))
    c = S.correction(s, jnp.asarray(d["prox"]), jnp.asarray(d["behav"]), jnp.asarray(d["mask"]), jnp.asarray(d["seg"]))
    np.testing.assert_array_equal(np.asarray(c.out.logp_old), d["behav"])
    assert math.isclose(float(c.flagged.sum()), 0.0)


@pytest.mark.parametrize("change,keys", [
    (dict(ratio_level="sequence", adv_estimator="gae", critic="shared", loss_agg="seq-mean-token-mean"),
     ("learner.ratio_level", "learner.adv_estimator")),
    (dict(ratio_level="sequence", critic="shared", loss_agg="seq-mean-token-mean"),
     ("learner.ratio_level", "learner.critic")),
    (dict(ratio_level="sequence"), ("learner.ratio_level", "learner.loss_agg")),
    (dict(off_policy="seq_tis", seq_is_low=0.5), ("learner.seq_is_low", "learner.off_policy")),
    (dict(off_policy="tis", seq_is_low=0.5), ("learner.seq_is_low", "learner.off_policy")),
    (dict(dynamic_sampling=True, adv_estimator="gae", critic="shared"),
     ("learner.dynamic_sampling", "learner.adv_estimator")),
    (dict(seq_is_high=0.9), ("learner.seq_is_high",)),
    (dict(off_policy="seq"), ("learner.off_policy",)),
    (dict(dynamic_sampling_max_retries=0), ("learner.dynamic_sampling_max_retries",)),
])
def test_combinations_that_cannot_combine_are_refused_naming_both_keys(change, keys):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(LearnerSection(), **change).validate("learner")
    for k in keys:
        assert k in str(e.value), (k, str(e.value))


def test_refused_at_finalize():
    from laminar_jax.config import finalize, repo_config

    c = repo_config("demo", "short")
    c.learner.ratio_level = "sequence"
    c.learner.loss_agg = "token-mean"
    with pytest.raises(ConfigError, match=r"learner\.ratio_level.*learner\.loss_agg"):
        finalize(c)
    c.learner.loss_agg = "seq-mean-token-mean"
    c.learner.off_policy = "seq_mask"
    c.learner.seq_is_ratio = "geometric"
    c.learner.seq_is_low = 0.99
    assert finalize(c).learner.ratio_level == "sequence"



def _record_metrics(monkeypatch):
    from laminar_jax.learner import Learner

    seen, step = [], Learner.step

    def recording(self, *a, **k):
        m = step(self, *a, **k)
        seen.append(m)
        return m

    monkeypatch.setattr(Learner, "step", recording)
    return seen


def test_gspo_with_sequence_tis_learns_the_toy_bandit(monkeypatch):
    from test_learner_rl import _assert_improves, run_toy

    section = LearnerSection(lr=5e-3, adv_estimator="grpo", critic="none", loss_agg="seq-mean-token-mean",
                             ratio_level="sequence", off_policy="seq_tis", seq_is_ratio="geometric",
                             seq_is_high=1.5, clip_eps_low=3e-3, clip_eps_high=4e-3, seq_len_buckets=(8, 16))
    metrics = _record_metrics(monkeypatch)
    _assert_improves(run_toy(section, steps=25, prompts_per_step=8, group=8))
    # On-policy toy: the proximal and behaviour policies agree, so no sequence is capped.
    assert len(metrics) == 25 and all(m["seq_capped_frac"] == 0.0 for m in metrics)


def test_seq_mask_drops_exactly_the_sequences_whose_behaviour_log_probs_are_off():
    """Through the Learner (prepare's proximal pass, packed rows, the loss's segment ids): half the
    trajectories carry behaviour log-probs 0.5 nat per token below what the policy gives them, so their
    geometric ratio is e^0.5 > seq_is_high and they are dropped; the rest stay."""
    from flax import nnx

    from laminar_jax.learner import Learner
    from laminar_jax.model import Transformer
    from laminar_jax.types import Trajectory
    from test_learner_rl import CFG, R, make_sampler

    section = LearnerSection(lr=1e-3, loss_agg="seq-mean-token-mean", ratio_level="sequence", off_policy="seq_mask",
                             seq_is_ratio="geometric", seq_is_high=1.2, seq_len_buckets=(8, 16), pack_length=32)
    learner = Learner(section, Transformer(CFG, rngs=nnx.Rngs(0)))
    sample = make_sampler(learner.graphs.actor, 2, R)
    prompts = np.stack([np.ones(16), np.repeat(np.arange(3, 7), 4)], axis=1).astype(np.int32)
    toks, lps = map(np.asarray, sample(learner.state.params["actor"], jnp.asarray(prompts), jax.random.key(1)))
    trajs = [Trajectory(f"p{i // 4}/{i % 4}", f"p{i // 4}", i % 4, prompts[i], toks[i],
                        lps[i] - (0.5 if i % 2 else 0.0), learner.version, reward=float(i % 3 == 0))
             for i in range(16)]
    m = learner.step(trajs)
    assert abs(m["seq_masked_frac"] - 0.5) < 1e-6, m
