"""The eval figures: pass@k against brute force, per-source grouping, the sink's bookkeeping, the schedule."""

import itertools
import math

import pytest

from laminar_jax.eval.metrics import EvalSample, pass_at_k, round_metrics, versions_seen
from laminar_jax.eval.rounds import EvalSink, eval_items, eval_share
from laminar_jax.eval.schedule import is_due


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c of them correct) that hold a correct one."""
    items = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(items[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 11))
def test_pass_at_k_equals_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    n, c, k = 2000, 3, 200
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, then one division
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(10_000, 0, 100) == 0.0 and pass_at_k(10_000, 10_000, 100) == 1.0


def test_pass_at_1_is_the_share_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


@pytest.mark.parametrize("n,c,k", [(4, 1, 0), (4, 1, 5), (4, 5, 2), (0, 0, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def _s(uid, src, greedy, reward, n=10, reason="eos", v=3):
    return EvalSample(uid, src, greedy, reward, n, reason, v)


def test_round_metrics_per_source_and_overall():
    samples = [
        _s("a", "math", True, 1.0, 4), _s("a", "math", False, 1.0, 6), _s("a", "math", False, 0.0, 8, "length"),
        _s("b", "math", True, 0.0, 2), _s("b", "math", False, 0.0, 2), _s("b", "math", False, 0.0, 2),
        _s("c", "code", True, 0.5, 10, v=4), _s("c", "code", False, 1.0, 10, v=4), _s("c", "code", False, 1.0, 10, v=4),
    ]
    m = round_metrics(samples, k=2, threshold=1.0)
    assert set(m) == {"math", "code", "overall"}
    assert m["math"]["acc"] == 0.5 and m["code"]["acc"] == 0.0 and m["overall"]["acc"] == pytest.approx(1 / 3)
    assert m["code"]["reward"] == 0.5
    assert m["math"]["pass@2"] == pytest.approx((1.0 + 0.0) / 2)  # a: 1 of 2 correct, k=2 -> 1; b: 0
    assert m["overall"]["pass@2"] == pytest.approx(2 / 3)
    assert m["math"]["truncation_rate"] == pytest.approx(1 / 6)
    assert m["math"]["response_len"] == pytest.approx((4 + 6 + 8 + 2 + 2 + 2) / 6)
    assert m["overall"]["prompts"] == 3 and m["overall"]["samples"] == 9
    # A graded reward just under the threshold is not correct.
    assert round_metrics([_s("x", "s", True, 0.999)], k=None, threshold=1.0)["s"]["acc"] == 0.0
    assert "pass@2" not in round_metrics(samples, k=None)["overall"]
    assert versions_seen(samples) == {"3": 6, "4": 3}


class _Prompt:
    def __init__(self, uid, ids):
        self.uid, self.prompt_ids, self.data_source, self.ground_truth, self.extra_info = uid, ids, "s", "t", {}


class _Rollout:
    max_prompt_len, max_new_tokens, max_total_len, top_k, top_p, stop_token_ids = 8, 10, 14, 0, 1.0, None


def test_eval_items_one_greedy_then_sampled_within_the_length_budget():
    items = eval_items([_Prompt("p0", [1, 2]), _Prompt("p1", list(range(8)))], 5, 3, 0.7, _Rollout, seed=0)
    assert len(items) == 8 and [it.sample_index for it in items[:4]] == [0, 1, 2, 3]
    assert items[0].sampling.temperature == 0.0 and {it.sampling.temperature for it in items[1:4]} == {0.7}
    assert items[0].sampling.max_new_tokens == 10 and items[4].sampling.max_new_tokens == 6  # 14 - 8
    assert all(it.round == 5 and it.uid.startswith("eval5:") for it in items)
    assert len({it.seed for it in items}) == 8


def test_eval_share_never_starves_training_nor_eval():
    assert eval_share(8, 100, 0) == 8 and eval_share(8, 100, 5) == 4 and eval_share(1, 3, 9) == 1
    assert eval_share(8, 2, 5) == 2 and eval_share(8, 0, 5) == 0 and eval_share(0, 4, 0) == 0


def test_sink_admits_by_version_and_closes_a_round_when_every_sample_is_scored():
    sink = EvalSink(k=2, threshold=1.0)
    items = eval_items([_Prompt("p0", [1, 2])], 0, 2, 1.0, _Rollout, seed=0)
    sink.start(0, 4, items)
    assert sink.waiting(3) == 0 and sink.take(3, 8) == []  # an older server never takes it
    got = sink.take(4, 2)
    assert len(got) == 2 and sink.waiting(5) == 1
    sink.requeue(got[1:])
    rest = sink.take(6, 8)
    assert [it.uid for it in rest] == [got[1].uid, items[2].uid]
    for it, v in zip([got[0], *rest], [4, 5, 6]):
        assert sink.pop_done() == []
        sink.add(it, 1.0, 7, "eos", v, learner_version=9)
    (rec,) = sink.pop_done()
    assert rec["step"] == rec["version"] == 4 and rec["versions"] == {"4": 1, "5": 1, "6": 1}
    assert rec["learner_version_at_done"] == 9 and rec["metrics"]["overall"]["pass@2"] == 1.0
    assert sink.in_flight() == [] and sink.pop_done() == []


def test_eval_points():
    assert [v for v in range(0, 11) if is_due(v, 4, 10)] == [4, 8, 10]
    assert not any(is_due(v, 0, 10) for v in range(11))


class FakeBuffer:
    """start_eval / poll_eval of the buffer service, with rounds finished by hand."""

    def __init__(self):
        self.started, self.running, self.finished = [], [], []

    def start_eval(self, round_id, version):
        self.started.append((round_id, version))
        self.running.append(round_id)
        return 4

    def poll_eval(self):
        done, self.finished = self.finished, []
        return {"done": done, "in_flight": list(self.running)}

    def finish(self, round_id):
        self.running.remove(round_id)
        self.finished.append({"round": round_id})


class _Rt:
    mode, eval_every, eval_before_train, total_steps, wait_timeout_s = "laminar", 2, True, 6, 1.0


def test_schedule_defers_a_due_round_behind_the_one_in_flight_and_owes_the_last_step():
    from laminar_jax.eval.schedule import Evaluation

    buf, seen = FakeBuffer(), []
    ev = Evaluation(_Rt, buf, seen.append)
    ev.begin(0)
    ev.after_step(1)
    ev.after_step(2)  # due, but round 0 runs: deferred
    assert buf.started == [(0, 0)] and ev.pending_since == 2
    buf.finish(0)
    ev.after_step(3)  # collected; the deferred round starts now, at version 3
    assert buf.started == [(0, 0), (1, 3)] and seen == [{"round": 0}]
    ev.after_step(4)
    ev.after_step(5)
    ev.after_step(6)  # the last step is due while round 1 runs
    assert len(buf.started) == 2
    buf.finish(1)
    ev.finish(6, timeout_s=0.2)  # round 1 collected, the owed round started and waited for (bounded)
    assert buf.started[-1] == (2, 6) and ev.in_flight == [2]


def test_round_figures_do_not_depend_on_the_order_samples_arrive_in():
    # Rewards whose float sum depends on its order: a round reproduced from an export must match.
    rewards = [0.7887233511355132, 0.0938595867742349, 0.02834747652200631, 0.8357651039198697,
               0.43276706790505337, 0.762280082457942, 0.0021060533511106927]
    assert sum(rewards) != sum(rewards[::-1])  # the case np.mean of arrival order got wrong
    samples = [EvalSample(f"p{i}", "src", True, r, 5 + i, "eos", 1) for i, r in enumerate(rewards)]
    a, b = round_metrics(samples, None), round_metrics(samples[::-1], None)
    assert a == b and a["overall"]["reward"] == math.fsum(rewards) / len(rewards)
