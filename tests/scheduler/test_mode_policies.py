"""Mode policies: dispatch gates, admission, and the swap barrier, as pure functions."""

import pytest

from laminar_jax.scheduler.modes import dispatch_allowance, get_policy, server_may_admit, swap_now

B = 8


def test_sync_dispatches_one_batch_per_learner_step():
    p = get_policy("sync")
    assert dispatch_allowance(p, 0, 0, B, None) == B
    assert dispatch_allowance(p, 0, B, B, None) == 0  # wait for the learner
    assert dispatch_allowance(p, 1, B, B, None) == B


def test_one_step_runs_one_batch_ahead():
    p = get_policy("one_step")
    assert dispatch_allowance(p, 0, 0, B, None) == 2 * B
    assert dispatch_allowance(p, 0, 2 * B, B, None) == 0
    assert dispatch_allowance(p, 1, 2 * B, B, None) == B


def test_stream_uses_areal_capacity_and_laminar_only_backpressure():
    s = get_policy("stream")
    assert dispatch_allowance(s, 3, 10, B, 2) == (2 + 3 + 1) * B - 10
    lam = get_policy("laminar")
    assert dispatch_allowance(lam, 3, 10, B, None) is None
    assert dispatch_allowance(lam, 3, 10, B, None, max_inflight_batches=2) == (2 + 3) * B - 10
    assert dispatch_allowance(lam, 3, 10, B, 1) == (1 + 3 + 1) * B - 10  # an explicit bound applies


def test_global_modes_swap_only_at_a_barrier():
    p = get_policy("stream")
    assert not server_may_admit(p, 1, 2, global_pending=True)
    assert server_may_admit(p, 2, 2, global_pending=False)
    assert not swap_now(p, 0, [0, 3])  # drained, but another server still has live sequences
    assert swap_now(p, 0, [0, 0])
    assert not swap_now(p, 2, [2, 0])


def test_laminar_servers_swap_on_their_own_when_drained():
    p = get_policy("laminar")
    assert not server_may_admit(p, 1, 2, global_pending=True)  # stop admitting old-version work
    assert server_may_admit(p, 2, 2, global_pending=True)  # others lagging does not matter
    assert swap_now(p, 0, [0, 5])
    assert not swap_now(p, 1, [1, 0])  # never with a live sequence: one version per trajectory
    assert p.repack and not get_policy("laminar", repack=False).repack
    assert not get_policy("sync").repack


def test_unknown_mode_is_named():
    with pytest.raises(ValueError, match="runtime.mode='fast'"):
        get_policy("fast")


def test_admit_lag_lets_a_laminar_server_admit_until_it_falls_that_far_behind():
    p = get_policy("laminar", admit_lag=2)
    assert server_may_admit(p, 3, 5, global_pending=True)  # 2 behind: still admitting
    assert not server_may_admit(p, 2, 5, global_pending=True)  # 3 behind: drains, then swaps
    assert swap_now(p, 0, [0, 4])  # an empty server still takes the newest at once
    # global modes have one barrier for all: the lag does not apply to them
    assert get_policy("stream", admit_lag=2).admit_lag == 0
    assert not server_may_admit(get_policy("one_step", admit_lag=2), 4, 5, global_pending=True)
    with pytest.raises(ValueError, match="admit_lag=-1"):
        get_policy("laminar", admit_lag=-1)
