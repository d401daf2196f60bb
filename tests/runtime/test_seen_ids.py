"""SeenIds: the monitor's record of trained trajectory uids, bounded at ~8 bytes per id."""

from laminar_jax.monitor.sink import SeenIds


def test_repeats_are_caught_before_and_after_a_merge():
    seen = SeenIds(merge_at=16)
    ids = [f"synthetic_skew/{i}@0/{k}" for i in range(20) for k in range(4)]
    assert all(seen.add(u) for u in ids) and len(seen) == 80
    assert not seen.add(ids[0]) and not seen.add(ids[-1])  # one in the merged array, one still recent
    assert [seen.add(u) for u in ("synthetic_skew/0@1/0", ids[40], "synthetic_skew/0@1/0")] == [True, False, False]
    assert len(seen) == 81


def test_memory_stays_at_eight_bytes_per_id():
    seen = SeenIds(merge_at=1000)
    for i in range(10_000):
        seen.add(f"openai/gsm8k/{i}@3/{i % 8}")
    assert len(seen) == 10_000 and seen._sorted.nbytes == 8 * 10_000 and not seen._recent
