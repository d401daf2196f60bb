"""Weight prefetch (rollout.prefetch) over a real relay on loopback, a real engine and a real worker:
the newer version is fetched while the server decodes its last sequences, so the swap after the
drain fetches nothing; a version superseded while it is fetched is dropped; a failed prefetch falls
back to the pull at swap time."""

import logging
import threading
import time

import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner.publish import flatten_params
from laminar_jax.net.auth import RunKeys
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.server import RelayServer
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.runtime.fleet import params_from_flat
from laminar_jax.weights.prefetch import Prefetcher
from laminar_jax.runtime.rollout_worker import RolloutWorker
from laminar_jax.scheduler.modes import get_policy
from tests.rollout.rollout_helpers import request

LEARNER = RunKeys.generate()
CFG = RelaySection(io_timeout_s=20.0, heartbeat_s=0.2)
# Two slots, sequences of a fixed length (no stop ids): the drain takes a known number of steps.
SECTION = RolloutSection(num_slots=2, page_size=8, num_pages=2 * 16 + 1, max_prompt_len=16, max_total_len=128,
                         max_new_tokens=100, prefill_buckets=(16,), temperature=1.0, stop_token_ids=())


class FakeBuffer:
    """Fake of the buffer service's board and work calls: no work; results accepted."""

    def report(self, i, name, version, live):
        return {"newest": 0, "learner_version": 0, "others": []}

    def take_work(self, i, name, version, free):
        return []

    def complete(self, name, traj):
        return True


class GatedClient(RelayClient):
    """A real relay client whose pulls are recorded (start, end, version) and, while `gate` is
    clear, held before they start: the test decides how long a pull overlaps decoding."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.pulls: list[tuple[float, float, int]] = []
        self.fail_next = False

    def pull(self, newer_than=-1, timeout=60.0, **kw):
        t0 = time.monotonic()
        assert self.gate.wait(timeout=30.0), "the test never released the pull"
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("injected: relay unreachable during prefetch")
        version, flat = super().pull(newer_than, timeout, **kw)
        self.pulls.append((t0, time.monotonic(), version))
        return version, flat


def _model(seed):
    """A model of its own (not the rollout tests' cached one: a swap deletes the buffers it replaces)."""
    return Transformer(PRESETS["tiny"], rngs=nnx.Rngs(seed))


def _flat(seed):
    return {k: np.asarray(v) for k, v in flatten_params(nnx.split(_model(seed))[1]).items()}


def _publish(relay, version, flat):
    with Publisher(CFG, relay_addresses=[relay.address], keys=LEARNER) as pub:
        pub.publish(version, flat)
        pub.flush(30)


def _worker(relay, prefetch):
    model = _model(0)
    engine, params = make_engine(model, SECTION)
    server = RolloutServer(engine, params, version=1)
    client = GatedClient([relay.address], config=CFG, keys=LEARNER.for_hosts())
    worker = RolloutWorker(0, "rollout-0", server, client, FakeBuffer(), get_policy("laminar"),
                           params_from_flat(model), pull_timeout_s=20.0, poll_s=0.0, prefetch=prefetch)
    return worker, server, client


def _assert_serves(server, flat):
    got = {k: np.asarray(v) for k, v in flatten_params(server._params).items()}
    assert set(got) == set(flat)
    for k in flat:
        assert got[k].tobytes() == flat[k].tobytes(), k


def _drain_and_swap(worker, server, client, release_after_steps):
    """Decode two live sequences; the newer version's pull is held until `release_after_steps`
    steps have run. Returns (steps decoded, monotonic time the drain ended)."""
    for i in range(2):
        server.submit(request(i, max_new=100), timeout=5.0)
    server.step()  # both in slots (as the worker's own admission would have them)
    assert server.num_live == 2
    client.gate.clear()
    steps, drained_at, deadline = 0, None, time.monotonic() + 120
    while server.version < 2:
        assert time.monotonic() < deadline, "no swap within 120 s"
        worker.iterate()
        steps += 1
        if steps == release_after_steps:
            client.gate.set()
        if drained_at is None and server.num_live == 0:
            drained_at = time.monotonic()
        if drained_at is None:
            assert server.version == 1  # never a swap with live sequences
    return steps, drained_at


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_swap_after_the_drain_fetches_nothing_when_prefetching(prefetch):
    with RelayServer(CFG, keys=LEARNER.for_hosts()) as relay:
        v1, v2 = _flat(0), _flat(1)
        _publish(relay, 1, v1)
        worker, server, client = _worker(relay, prefetch)
        try:
            _publish(relay, 2, v2)
            _, drained_at = _drain_and_swap(worker, server, client, release_after_steps=10)
            assert [v for *_, v in client.pulls] == [2]
            (start, end, _), = client.pulls
            if prefetch:
                # fetched while the last sequences decoded: the swap only copied it in
                assert end < drained_at
                assert worker.prefetch.stats()["taken"] == 1
            else:  # without prefetch the whole pull follows the drain (what prefetch removes)
                assert start > drained_at
            _assert_serves(server, v2)
            assert worker.swaps == 1
            (_, stall, version, ahead), = worker.take_swaps()
            assert version == 2 and ahead == prefetch and stall >= 0.0
        finally:
            assert worker.close(timeout=30.0)


def test_a_failed_prefetch_falls_back_to_the_pull_at_swap_time(caplog):
    with RelayServer(CFG, keys=LEARNER.for_hosts()) as relay:
        _publish(relay, 1, _flat(0))
        worker, server, client = _worker(relay, prefetch=True)
        try:
            v2 = _flat(1)
            _publish(relay, 2, v2)
            client.fail_next = True
            with caplog.at_level(logging.WARNING, logger="laminar_jax.weights.prefetch"):
                _drain_and_swap(worker, server, client, release_after_steps=5)
            assert any("prefetch" in r.message and "injected" in r.message for r in caplog.records)
            st = worker.prefetch.stats()
            assert st["failures"] == 1 and st["taken"] == 0 and "injected" in st["last_error"]
            _assert_serves(server, v2)
            (_, _, version, ahead), = worker.take_swaps()
            assert version == 2 and not ahead
        finally:
            assert worker.close(timeout=30.0)


def test_a_version_superseded_while_prefetching_is_dropped_for_the_newest():
    with RelayServer(CFG, keys=LEARNER.for_hosts()) as relay:
        flats = {v: {"w": np.full(4096, v, np.float32)} for v in (1, 2, 3)}
        _publish(relay, 1, flats[1])
        _publish(relay, 2, flats[2])
        client = RelayClient([relay.address], config=CFG, keys=LEARNER.for_hosts())
        gate, fetched = threading.Event(), []

        def fetch(newer_than):
            version, flat = client.pull(newer_than, timeout=20.0, copy=True)
            fetched.append(version)
            assert gate.wait(30.0)  # version 2's fetch ends only after version 3 is announced
            return version, flat

        p = Prefetcher("rollout-0", fetch)
        try:
            p.announce(2, current=1)
            deadline = time.monotonic() + 30
            while not fetched:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            _publish(relay, 3, flats[3])
            p.announce(3, current=1)
            gate.set()
            while p.stats()["staged"] != 3:  # version 2 staged, dropped as 3 is due, 3 fetched
                assert time.monotonic() < deadline, p.stats()
                time.sleep(0.01)
            staged = p.take(current=1, timeout=30.0)
            assert fetched == [2, 3] and staged.version == 3
            assert staged.payload["w"].tobytes() == flats[3]["w"].tobytes()
            st = p.stats()
            assert st["superseded"] == 1 and st["fetched"] == 2 and st["taken"] == 1
            assert st["staged"] is None and st["failures"] == 0
            assert p.take(current=3, timeout=0.0) is None  # never more than the one staged version
        finally:
            assert p.close(timeout=30.0)
            client.close()


def test_the_timeline_gives_the_summary_swap_stall_percentiles_and_the_staged_share(tmp_path):
    from laminar_jax.monitor.timeline import Timeline

    tl = Timeline(t0=100.0)
    assert tl.swap_figures() == {"swap_stall_p50_s": None, "swap_stall_p99_s": None, "swap_staged_frac": None,
                                 "swaps": 0, "swap_stall_staged_p50_s": None}
    for i, (stall, staged) in enumerate([(0.01, True), (0.02, True), (0.03, True), (1.0, False)]):
        tl.swap(101.0 + i, f"rollout-{i % 2}", stall, i + 2, staged)
    f = tl.swap_figures()
    assert f["swaps"] == 4 and f["swap_staged_frac"] == 0.75 and f["swap_stall_staged_p50_s"] == pytest.approx(0.02)
    assert f["swap_stall_p50_s"] == pytest.approx(0.025) and 0.9 < f["swap_stall_p99_s"] <= 1.0
    assert tl.swaps[0][:2] == (1.0, "rollout-0")  # times relative to the timeline's t0
    for t in (100.5, 106.0):
        tl.sample(t, "rollout-0", 1, 2, 2)
    assert tl.render(str(tmp_path / "timeline.png")).endswith("timeline.png")  # stalls drawn per server


def test_prefetch_device_without_prefetch_is_refused_naming_the_key():
    from laminar_jax.configlib import ConfigError

    with pytest.raises(ConfigError, match="rollout.prefetch_device"):
        RolloutSection(prefetch=False, prefetch_device=True).validate()
