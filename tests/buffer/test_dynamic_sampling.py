"""Dynamic sampling (DAPO) in the buffer: the zero-signal group filter, its refill bound, the store
and ledger accounting of filtered groups, and the dispatcher replacing them with fresh prompts."""

import numpy as np
import pytest

from laminar_jax.buffer import (DuplicatePrompt, ExperienceStore, GroupMeta, PromptLedger, select_fifo,
                                select_with_signal, zero_signal)

FIELDS = ("response_ids", "reward")


def _g(name, rewards, seq, version=0):
    return GroupMeta(name, tuple(range(seq * 10, seq * 10 + len(rewards))), version, 10, seq, tuple(rewards))


def test_zero_signal_means_every_member_scored_the_same():
    assert zero_signal(_g("a", [1.0, 1.0, 1.0], 0)) and zero_signal(_g("a", [0.0, 0.0], 0))
    assert not zero_signal(_g("a", [0.0, 1.0, 0.0], 0)) and not zero_signal(_g("a", [0.5, 0.5000001], 0))
    assert not zero_signal(_g("a", [1.0], 0))  # a group of one is not judged (no group estimator takes it)
    missing = GroupMeta("a", (1, 2), 0, 10, 0, (1.0,))
    assert not zero_signal(missing)  # a reward not written yet: not judged


def test_filtered_groups_leave_in_fifo_order_and_later_groups_stay():
    groups = [_g("z0", [1, 1], 0), _g("s0", [0, 1], 1), _g("z1", [0, 0], 2), _g("s1", [1, 0], 3),
              _g("z2", [1, 1], 4), _g("s2", [0, 1], 5)]
    sel = select_with_signal(groups[::-1], 2, learner_version=0, budget=10)  # input order does not matter
    assert [g.group for g in sel.take] == ["s0", "s1"]
    assert [g.group for g in sel.filtered] == ["z0", "z1"]  # z2 comes after the batch filled: next batch's
    assert sel.drop == ()


def test_zero_signal_groups_leave_even_before_the_batch_is_full():
    """So that the dispatcher can replace them while the batch waits."""
    sel = select_with_signal([_g("z0", [1, 1], 0), _g("s0", [0, 1], 1)], 3, learner_version=0, budget=10)
    assert sel.take == () and [g.group for g in sel.filtered] == ["z0"]


def test_refill_bound_takes_zero_signal_groups_past_it():
    groups = [_g(f"z{i}", [1, 1], i) for i in range(5)] + [_g("s0", [0, 1], 5)]
    sel = select_with_signal(groups, 2, learner_version=0, budget=3)
    assert [g.group for g in sel.filtered] == ["z0", "z1", "z2"]
    assert [g.group for g in sel.take] == ["z3", "z4"]
    none_left = select_with_signal(groups, 2, learner_version=0, budget=0)
    assert none_left.filtered == () and [g.group for g in none_left.take] == ["z0", "z1"]


def test_without_zero_signal_groups_it_selects_as_fifo_does_staleness_included():
    groups = [_g("old", [0, 1], 0, version=0), _g("a", [0, 1], 1, version=5), _g("b", [1, 0], 2, version=5)]
    for on_stale in ("drop", "skip"):
        got = select_with_signal(groups, 2, 6, budget=4, max_staleness=2, on_stale=on_stale)
        want = select_fifo(groups, 2, 6, max_staleness=2, on_stale=on_stale)
        assert (got.take, got.drop, got.filtered) == (want.take, want.drop, ())
    # a stale zero-signal group is dropped as stale, not filtered
    sel = select_with_signal([_g("z", [1, 1], 0, version=0)], 1, 6, budget=4, max_staleness=2)
    assert [g.group for g in sel.drop] == ["z"] and sel.filtered == ()


def _fill(store, group, rewards):
    for i, r in enumerate(rewards):
        store.add_row(f"{group}/{i}", group, {"prompt_ids": np.arange(3), "response_ids": np.arange(2),
                                              "version": 0, "reward": r})


def test_store_marks_filtered_groups_consumed_and_counts_them():
    s = ExperienceStore(group_size=2)
    _fill(s, "z", [1.0, 1.0])
    _fill(s, "a", [0.0, 1.0])
    rows = s.get("learner", 1, FIELDS, timeout=1, select=lambda gs, n: select_with_signal(gs, n, 0, budget=5))
    assert sorted(r["uid"] for r in rows) == ["a/0", "a/1"]
    assert s.counters["groups_filtered"] == 1 and s.counters["groups_dropped_stale"] == 0
    assert s.ready_groups("learner", FIELDS) == 0  # z is consumed (never offered again)
    assert s.evict_consumed(["learner"]) == 4


def test_ledger_filtered_state_ends_a_prompt_and_survives_a_checkpoint():
    led = PromptLedger()
    for u in ("a", "b", "c"):
        led.dispatch(u, {"uid": u})
    led.filter("a")
    led.consume("b")
    with pytest.raises(DuplicatePrompt, match="already filtered"):
        led.consume("a")  # consumed without training: never trained afterwards
    with pytest.raises(DuplicatePrompt):
        led.dispatch("a", {"uid": "a"})
    assert led.untrained() == 1
    assert led.summary() == {"total": 3, "in_flight": 1, "consumed": 1, "dropped": 0, "filtered": 1,
                             "duplicated": 1}
    again = PromptLedger()
    again.load_state_dict(led.state_dict())
    assert again.summary() == led.summary() and again.state_of("a") == "filtered" and again.untrained() == 1
    before = PromptLedger()  # a checkpoint written before the 'filtered' state existed loads as it was
    before.dispatch("x", {"uid": "x"})
    state = before.state_dict()
    state["counters"].pop("filtered")
    older = PromptLedger()
    older.load_state_dict(state)
    assert older.summary()["filtered"] == 0 and older.untrained() == 0 and older.state_of("x") == "dispatched"

def test_dispatcher_replaces_filtered_prompts_with_fresh_ones():
    """sync mode dispatches one batch per learner version; a filtered prompt frees its place."""
    from laminar_jax.buffer.dispatch import Dispatcher, WorkQueue
    from laminar_jax.scheduler.modes import get_policy

    class Prompt:  # a fake prompt source: the dispatcher reads these fields only
        def __init__(self, i):
            self.uid, self.prompt_ids, self.data_source, self.ground_truth, self.extra_info = \
                f"p{i}", [1, 2], "toy", "", {}

    src = iter([Prompt(i) for i in range(100)])
    led, store, queue = PromptLedger(), ExperienceStore(group_size=2), WorkQueue()
    d = Dispatcher(src, led, store, queue, get_policy("sync", False, 0), prompts_per_step=4, samples_per_prompt=2,
                   max_staleness=None, seed=0, max_queued_prompts=64)
    assert d.pump(0) == 4 and d.pump(0) == 0
    led.filter("p0")
    led.filter("p1")
    assert d.pump(0) == 2 and led.summary()["in_flight"] == 4
