"""Repack policy: grouping by version, source rule, best-fit destination, bounds."""

from laminar_jax.scheduler import RepackParams, ServerView, plan_repack


def sv(sid, version, used, prev, seqs, total=100, alive=True):
    return ServerView(sid, version, total, used, prev, tuple((f"{sid}:{i}", n) for i, n in enumerate(seqs)), alive)


P = RepackParams(c_max=0.99, max_batch=8)


def test_draining_server_moves_to_fullest_feasible_destination():
    servers = [sv("a", 1, 10, 20, [5, 5]),          # source: low, falling, 2 live
               sv("b", 1, 60, 60, [10] * 6),        # fits: 70 pages, 8 live -> fullest
               sv("c", 1, 30, 30, [10, 10, 10])]    # fits too, but ends emptier
    moves = plan_repack(servers, P)
    assert {(m.src, m.dst) for m in moves} == {("a", "b")}
    assert sorted(m.seq_uid for m in moves) == ["a:0", "a:1"]


def test_no_move_across_versions_or_to_dead_servers():
    servers = [sv("a", 1, 10, 20, [5, 5]), sv("b", 2, 50, 50, [10] * 5), sv("c", 1, 50, 50, [10] * 5, alive=False)]
    assert plan_repack(servers, P) == []


def test_batch_bound_and_capacity_bound_are_respected():
    too_many = [sv("a", 1, 10, 20, [5, 5]), sv("b", 1, 40, 40, [5] * 7)]  # 9 live > B=8
    assert plan_repack(too_many, P) == []
    too_big = [sv("a", 1, 30, 40, [15, 15]), sv("b", 1, 80, 80, [40, 40])]  # 110 pages > 99
    assert plan_repack(too_big, P) == []


def test_rising_server_is_not_a_source_and_ascending_order():
    rising = [sv("a", 1, 10, 5, [5, 5]), sv("b", 1, 50, 50, [10] * 5)]
    assert plan_repack(rising, P) == []
    servers = [sv("x", 1, 20, 30, [10, 10]), sv("y", 1, 5, 10, [5]), sv("z", 1, 40, 40, [10] * 4)]
    moves = plan_repack(servers, P)
    # y (lowest) goes first, to the fullest feasible: z (45) beats x (25)
    assert [(m.src, m.dst) for m in moves if m.src == "y"] == [("y", "z")]
    # a server that received sequences is never emptied afterwards; each sequence moves once
    assert len({m.seq_uid for m in moves}) == len(moves)
    assert not any(m.src == "z" for m in moves)


def test_a_server_draining_for_a_newer_version_is_a_source_even_when_its_kv_rose():
    # Polled right after a publish: the admissions since the last poll make KV look rising, but the
    # server admits nothing more (it knows of a newer version), so its batch can only shrink.
    rising = [sv("a", 1, 10, 5, [5, 5]), sv("b", 1, 50, 50, [10] * 5)]
    assert plan_repack(rising, P) == []
    draining = [ServerView("a", 1, 100, 10, 5, (("a:0", 5), ("a:1", 5)), draining=True),
                ServerView("b", 1, 100, 50, 50, tuple((f"b:{i}", 10) for i in range(5)), draining=True)]
    assert {(m.src, m.dst) for m in plan_repack(draining, P)} == {("a", "b")}


def test_destination_never_gets_more_sequences_than_its_slots():
    # B=8 would allow 5 + 2 = 7 live on b, but b has only 6 slots: the move would fail on import.
    servers = [ServerView("a", 1, 100, 10, 20, (("a:0", 5), ("a:1", 5))),
               ServerView("b", 1, 100, 50, 50, tuple((f"b:{i}", 10) for i in range(5)), max_live=6)]
    assert plan_repack(servers, P) == []
    servers[1] = ServerView("b", 1, 100, 50, 50, tuple((f"b:{i}", 10) for i in range(5)), max_live=7)
    assert {(m.src, m.dst) for m in plan_repack(servers, P)} == {("a", "b")}
