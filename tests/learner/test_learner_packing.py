"""Sequence packing: collate places every trajectory once, and a packed step equals an unpacked one."""

import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection, collate
from laminar_jax.learner.batch import row_bucket, stratified_order
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.types import Trajectory
from tests.compile_events import count_compiles


def _batch(seed: int, n: int = 12, group: int = 4):
    """Long-tail response lengths (1..40 tokens) so packing has something to do."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = rng.integers(3, 100, int(rng.choice([1, 2, 3, 5, 8, 40])))
        p = rng.integers(3, 100, int(rng.integers(1, 6)))
        out.append(Trajectory(f"s{seed}p{i // group}/{i % group}", f"s{seed}p{i // group}", i % group, p, r,
                              rng.normal(-4.8, 0.3, len(r)).astype(np.float32), 0, reward=float(rng.random())))
    return out


def test_packed_collate_places_every_trajectory_once():
    trajs = _batch(0)
    b = collate(trajs, (64,), row_multiple=2, pack_length=48)
    assert b.tokens.shape[1] == 48 and b.tokens.shape[0] % 2 == 0
    assert b.tokens.shape[0] < len(trajs)  # fewer rows than trajectories
    for i, tr in enumerate(trajs):
        where = b.seq_ids == i
        rows = np.unique(np.nonzero(where)[0])
        assert len(rows) == 1, f"trajectory {i} split over rows {rows}"
        seq = np.concatenate([tr.prompt_ids, tr.response_ids])
        np.testing.assert_array_equal(b.tokens[where], seq)
        np.testing.assert_array_equal(b.positions[where], np.arange(len(seq)))
        assert b.loss_mask[where].sum() == len(tr.response_ids)
        np.testing.assert_allclose(b.behaviour_logprobs[where][len(tr.prompt_ids) - 1:-1], tr.behaviour_logprobs)
        assert len(np.unique(b.segment_ids[where])) == 1  # one segment id, distinct within its row
    for row in range(b.tokens.shape[0]):
        segs = b.segment_ids[row][b.segment_ids[row] > 0]
        assert len(np.unique(segs)) == len(np.unique(b.seq_ids[row][b.seq_ids[row] >= 0]))
    assert (b.seq_ids >= 0).sum() == sum(t.num_tokens for t in trajs)


def test_overlong_trajectory_names_itself():
    trajs = _batch(1)
    with pytest.raises(ValueError, match=r"trajectory\[\d+\] uid='s1p\d/\d': \d+ tokens exceed learner.pack_length=16"):
        collate(trajs, (64,), pack_length=16)


@pytest.mark.parametrize("kind", ["grpo", "gae"])
def test_packed_step_equals_unpacked(kind):
    base = dict(lr=1e-3, mini_batches=1, micro_batches=2, seq_len_buckets=(16, 32, 64), seed=3)
    if kind == "grpo":
        base.update(adv_estimator="grpo", loss_agg="seq-mean-token-mean", off_policy="tis")
        model = lambda: Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    else:
        base.update(adv_estimator="gae", critic="shared", loss_agg="seq-mean-token-sum", kl_mode="reward",
                    kl_coef=0.05, whiten_advantages=False)
        model = lambda: Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), value_head=True)
    plain = Learner(LearnerSection(**base), model())
    packed = Learner(LearnerSection(**base, pack_length=64), model())
    for seed in (5, 6):
        trajs = _batch(seed)
        m_plain, m_packed = plain.step(trajs), packed.step(trajs)
        assert m_packed["rows"] < m_plain["rows"]
        for k in ("loss", "pg_loss", "entropy", "reward_mean"):
            np.testing.assert_allclose(m_packed[k], m_plain[k], rtol=2e-5, atol=1e-6, err_msg=k)
    a, b = plain.policy_params(), packed.policy_params()
    # atol: Adam divides each gradient by its own running scale, so a weight whose gradient is near
    # zero moves by up to lr per step on float rounding alone (packed rows sum in another order).
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert any(not np.array_equal(a[n], Learner(LearnerSection(**base), model()).policy_params()[n]) for n in a)


def test_packed_mini_batches_are_whole_trajectory_blocks():
    trajs = _batch(2, n=16)
    order = np.random.default_rng(0).permutation(16)
    b = collate(trajs, (64,), row_multiple=8, pack_length=48, mini_batches=4, order=order)
    per = b.tokens.shape[0] // 4
    assert per % 2 == 0  # row_multiple / mini_batches
    for j, part in enumerate(np.array_split(order, 4)):
        block = b.seq_ids[j * per:(j + 1) * per]
        assert set(np.unique(block[block >= 0])) == set(part.tolist())


MESH_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, os.path.join(sys.argv[1], "tests", "learner"))
import jax, numpy as np
from flax import nnx
from jax.sharding import Mesh
from test_learner_packing import _batch
from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.model import PRESETS, Transformer
sec = LearnerSection(lr=1e-3, adv_estimator="grpo", mini_batches=2, ppo_epochs=2, off_policy="tis",
                     loss_agg="seq-mean-token-mean", pack_length=64, seq_len_buckets=(64,))
out = []
for n, shape in ((1, (1, 1, 1)), (4, (1, 4, 1))):
    mesh = Mesh(np.asarray(jax.devices()[:n], dtype=object).reshape(shape), ("data", "fsdp", "tensor"))
    learner = Learner(sec, Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)), mesh=mesh)
    losses = [learner.step(_batch(s, n=16))["loss"] for s in range(3)]
    out.append((losses, learner.policy_params()))
np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-4)
for k in out[0][1]:
    np.testing.assert_allclose(out[1][1][k], out[0][1][k], atol=5e-5, err_msg=k)
print("PACKED_MESH_OK")
"""


def test_packed_steps_on_a_mesh_match_one_device():
    """Packed mini-batches are chosen over trajectories, not rows: fsdp=4 (more padding rows)
    trains exactly what one device trains (fp32, 3 steps x 2 epochs x 2 mini-batches)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, root], capture_output=True, text=True, timeout=600,
                          env=env)
    assert "PACKED_MESH_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_row_buckets_split_each_doubling():
    assert [row_bucket(n, 1) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [row_bucket(n, 2) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert [row_bucket(n, 4) for n in range(8, 13)] == [8, 10, 10, 12, 12]


def test_stratified_order_deals_each_stratum_one_to_each_mini_batch():
    lengths = list(np.random.default_rng(0).permutation(18) + 1)  # distinct, so the strata are exact
    parts_seen = set()
    for seed in range(6):
        order = stratified_order(np.random.default_rng(seed), lengths, 4)
        assert sorted(order.tolist()) == list(range(18))
        parts = np.array_split(order, 4)
        assert [len(p) for p in parts] == [5, 5, 4, 4]  # collate's split of any order of 18
        by_length = sorted(range(18), key=lambda i: -lengths[i])
        for start in range(0, 16, 4):  # every full stratum: one member in each part
            stratum = set(by_length[start:start + 4])
            assert all(len(stratum & set(p.tolist())) == 1 for p in parts)
        assert set(by_length[16:]) == set(parts[0].tolist() + parts[1].tolist()) - set(by_length[:16])
        parts_seen.add(tuple(sorted(parts[0].tolist())))
    assert len(parts_seen) > 1  # still a random draw


def _grpo_like(seed: int, groups: int = 4, group: int = 8):
    """Groups of equal-length samples with a long-tail length per group (the RL loop's shape)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        n = int(min(60, rng.geometric(1 / 10)))
        for i in range(group):
            out.append(Trajectory(f"s{seed}p{g}/{i}", f"s{seed}p{g}", i, np.array([1, 5, 6]), rng.integers(3, 100, n),
                                  rng.normal(-4.8, 0.3, n).astype(np.float32), 0, reward=float(rng.random())))
    return out


def test_stratified_draw_and_finer_row_buckets_pad_fewer_rows():
    """Over long-tail batches, the stratified draw and midpoint row buckets pack the same
    trajectories into fewer rows than a random draw and power-of-two buckets."""
    rows = {"random/pow2": 0, "stratified/pow2": 0, "stratified/half": 0}
    for seed in range(40):
        trajs = _grpo_like(seed)
        lengths = [t.num_tokens for t in trajs]
        rnd = np.random.default_rng(seed).permutation(len(trajs))
        strat = stratified_order(np.random.default_rng(seed), lengths, 4)
        for key, order, per in (("random/pow2", rnd, 1), ("stratified/pow2", strat, 1), ("stratified/half", strat, 2)):
            b = collate(trajs, (64,), row_multiple=4, pack_length=64, mini_batches=4, order=order,
                        rows_per_doubling=per)
            assert (b.seq_ids >= 0).sum() == sum(lengths)
            rows[key] += b.tokens.shape[0]
    assert rows["stratified/half"] < rows["stratified/pow2"] < rows["random/pow2"], rows


def test_packed_warmup_compiles_every_row_bucket_ahead():
    section = LearnerSection(lr=1e-3, adv_estimator="grpo", mini_batches=4, pack_length=64, seq_len_buckets=(64,),
                             pack_rows_per_doubling=2)
    learner = Learner(section, Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    with count_compiles() as compiles:
        assert learner.warmup(16) == 4  # 1, 2, 3 and 4 rows per mini-batch (up to a row per trajectory)
        before, shapes = len(compiles), set()
        for seed in range(8):
            trajs = _grpo_like(seed, groups=2)
            shapes.add(learner.step(trajs)["rows"])
        assert len(compiles) == before, f"steps after warmup compiled {len(compiles) - before} programs"
    assert shapes & {12}, shapes  # a midpoint bucket (3 rows per mini-batch) was used


def test_packed_rows_shrink_to_the_shortest_length_that_holds_the_longest_trajectory():
    short = [t for t in _batch(0) if t.num_tokens <= 16] + [t for t in _batch(3) if t.num_tokens <= 16]
    assert max(t.num_tokens for t in short) > 8
    b = collate(short, (64,), pack_length=48, pack_lengths=(8, 16, 32, 48))
    assert b.tokens.shape[1] == 16  # 8 cannot hold the longest, 16 can
    assert (b.seq_ids >= 0).sum() == sum(t.num_tokens for t in short)
    assert collate(_batch(0), (64,), pack_length=48, pack_lengths=(8, 16, 32, 48)).tokens.shape[1] == 48  # a 40+ token one
    assert collate(short, (64,), pack_length=48).tokens.shape[1] == 48  # no shorter lengths given: pack_length


def test_shrunk_rows_train_the_same_as_rows_of_pack_length():
    """Rows attend within their segments, so the row length changes the cost, not the step."""
    base = dict(lr=1e-3, adv_estimator="grpo", mini_batches=2, seq_len_buckets=(16, 32, 64), pack_length=64, seed=3)
    model = lambda: Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    fixed = Learner(LearnerSection(**base, pack_shrink=False), model())
    shrunk = Learner(LearnerSection(**base, pack_shrink=True), model())
    assert shrunk.pack_lengths == (16, 32, 64) and fixed.pack_lengths == (64,)
    lengths = set()
    for seed in (5, 6, 7):
        trajs = [t for t in _batch(seed, n=16) if t.num_tokens <= 32]
        m_fixed, m_shrunk = fixed.step(trajs), shrunk.step(trajs)
        assert m_fixed["seq_len"] == 64
        lengths.add(m_shrunk["seq_len"])
        for k in ("loss", "pg_loss", "entropy", "reward_mean", "num_tokens"):
            np.testing.assert_allclose(m_shrunk[k], m_fixed[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert lengths <= {16, 32} and lengths, lengths
    a, b = fixed.policy_params(), shrunk.policy_params()
    for name in a:  # atol: as in test_packed_step_equals_unpacked (Adam on near-zero gradients)
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_packed_warmup_compiles_every_row_length_ahead():
    section = LearnerSection(lr=1e-3, adv_estimator="grpo", mini_batches=4, pack_length=64, seq_len_buckets=(32, 64),
                             pack_rows_per_doubling=2, pack_shrink=True)
    learner = Learner(section, Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    with count_compiles() as compiles:
        assert learner.warmup(16, 64) == 8  # 1, 2, 3, 4 rows per mini-batch, at 32 and at 64 tokens
        before, lengths = len(compiles), set()
        for seed in range(8):
            lengths.add(learner.step(_grpo_like(seed, groups=2))["seq_len"])
        assert len(compiles) == before, f"steps after warmup compiled {len(compiles) - before} programs"
    assert lengths == {32, 64}, lengths
    assert learner.warmup(16, 20) == 4  # trajectories of at most 20 tokens: rows of 32 only
