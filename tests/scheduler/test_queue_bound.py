"""The dispatcher's work-queue bound as pure functions (the simulator models the runtime with them)."""

from laminar_jax.scheduler import modes


def test_default_max_queued_prompts():
    assert modes.default_max_queued_prompts(8, 2) == 8  # one step's prompts when servers are few
    assert modes.default_max_queued_prompts(8, 6) == 12  # two per server otherwise
    assert modes.default_max_queued_prompts(512, 1024) == 2048


def test_queue_room_counts_whole_prompts():
    assert modes.queue_room(10, 0, 16) == 10
    assert modes.queue_room(10, 16 * 3, 16) == 7
    assert modes.queue_room(10, 16 * 3 + 5, 16) == 7  # floor: the runtime counts len(queue) // samples
    assert modes.queue_room(10, 16 * 12, 16) == -2  # over the bound: nothing may go out


def test_back_pressure_window():
    lam = modes.get_policy("laminar")
    # (max_inflight_batches + learner_version) * B - dispatched
    assert modes.dispatch_allowance(lam, 3, 400, 128, None, 2) == (2 + 3) * 128 - 400
    assert modes.dispatch_allowance(lam, 3, 400, 128, None, None) is None
