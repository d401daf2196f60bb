"""Timeline utilization figures are time-weighted per server (pure logic)."""

from laminar_jax.monitor.timeline import Timeline


def test_slot_and_kv_utilization_are_time_weighted():
    tl = Timeline(0.0)
    # server a: 4/4 slots for 1 s then 0/4 for 3 s; server b: 2/4 for 4 s.
    for t, used in ((0.0, 4), (1.0, 0), (4.0, 0)):
        tl.sample(t, "a", used, 4, 0, kv_used=used * 2, kv_total=10)
    for t in (0.0, 4.0):
        tl.sample(t, "b", 2, 4, 0)  # no KV figures from this server
    assert abs(tl.slot_utilization() - (4 * 1 + 2 * 4) / (4 * 4 + 4 * 4)) < 1e-12
    assert abs(tl.kv_utilization() - (8 * 1) / (10 * 4)) < 1e-12
    assert Timeline(0.0).kv_utilization() is None


def test_repeated_samples_are_kept_as_change_points(tmp_path):
    tl = Timeline(0.0)
    for i in range(20000):  # a server iterating at ~1 kHz for 20 s: 5 s full, 15 s with 1 slot
        tl.sample(i / 1000, "a", 8 if i < 5000 else 1, 8, 0 if i < 5000 else 1, kv_used=40, kv_total=80)
    assert len(tl.samples) == 2 and len(tl.kv) == 1
    expected = (8 * 5.0 + 1 * 14.999) / (8 * 19.999)
    assert abs(tl.slot_utilization() - expected) < 1e-9
    assert abs(tl.kv_utilization() - 0.5) < 1e-12
    assert tl.render(str(tmp_path / "t.png")) and (tmp_path / "t.png").stat().st_size > 0


def test_render_starts_at_the_rl_clock_with_a_version_colour_scale(tmp_path):
    tl = Timeline(100.0)  # process start
    for v in range(80):  # 80 versions: a colour scale, not a legend
        tl.sample(300.0 + v, "a", 1 + v % 4, 4, v)
        tl.publish(300.0 + v, v)
    samples, publishes = tl.relative_to(300.0)  # the RL clock started 200 s after the process
    assert min(t for t, *_ in samples) == 0.0 and publishes[0] == (0.0, 0) and publishes[-1] == (79.0, 79)
    assert tl.render(str(tmp_path / "t.png"), t_start=300.0) and (tmp_path / "t.png").stat().st_size > 0
