"""bench learner --packing: the skewed task's batches, and one short side-by-side run."""

import numpy as np
import pytest

from laminar_jax.benchmarks import packing
from laminar_jax.data.synthetic_skew import SkewTask, sample_problem


def test_skew_batches_carry_the_tasks_lengths_a_group_apiece():
    batches = packing.skew_batches(3, prompts=4, samples=5, seed=1)
    assert [len(b) for b in batches] == [20, 20, 20]
    for b, trajs in enumerate(batches):
        for g in range(4):
            group = trajs[g * 5:(g + 1) * 5]
            p = sample_problem(SkewTask(), 1, b * 4 + g)
            assert {t.prompt_uid for t in group} == {f"b{b}p{g}"}
            assert all(len(t.prompt_ids) == len(p.prompt) + 1 and len(t.response_ids) == len(p.target) + 1
                       for t in group)
            assert all(len(t.behaviour_logprobs) == len(t.response_ids) for t in group)
    again = packing.skew_batches(3, prompts=4, samples=5, seed=1)
    assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(batches[2], again[2]))


@pytest.mark.slow  # three learners warm every row bucket of the demo's geometry (~2 min on 2 cores)
def test_packing_bench_times_every_variant_on_the_same_batches():
    r = packing.run(steps=3, batches=3)
    assert r["bench"] == "learner_packing" and set(r["variants"]) == {"random/1", "stratified/1", "stratified/2"}
    v = r["variants"]
    assert v["stratified/2"]["warmup"]["shapes"] > v["random/1"]["warmup"]["shapes"]  # the midpoints compile too
    for x in v.values():
        assert 0 < x["fill"] <= 1 and x["rows_mean"] >= 4 and x["wall_ms"]["mean"] > 0
    assert v["random/1"]["wall_vs_random_pow2"] == 1.0
    assert v["stratified/2"]["rows_mean"] <= v["random/1"]["rows_mean"]
