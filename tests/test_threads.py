"""The supervised-thread primitive: a worker's exception is kept with its traceback and re-raised by
check(), naming the worker; a failure stops its owner's other workers unless isolated."""

import threading
import time

import pytest

from laminar_jax.threads import Worker, WorkerFailed, WorkerGroup


def _boom():
    raise ValueError("boom in the worker")


def test_a_failure_is_reraised_with_name_and_traceback_and_stops_the_group():
    group = WorkerGroup()
    other = group.spawn("patient", lambda: group.stop.wait(30.0))
    failing = group.spawn("failing", _boom)
    assert failing.join(5.0) and other.join(5.0)  # the failure set the shared stop event
    with pytest.raises(WorkerFailed, match="(?s)'failing' died.*ValueError.*boom in the worker.*_boom") as e:
        group.check()
    assert isinstance(e.value.__cause__, ValueError)


def test_an_isolated_worker_keeps_its_error_without_stopping_others():
    stop = threading.Event()
    w = Worker("isolated", _boom, stop, stop_on_failure=False).start()
    assert w.join(5.0) and not stop.is_set()
    assert isinstance(w.error, ValueError) and "_boom" in w.traceback
    with pytest.raises(WorkerFailed):
        w.check()


def test_join_names_the_workers_that_do_not_stop():
    group = WorkerGroup()
    release = threading.Event()
    group.spawn("stubborn", lambda: release.wait(30.0))  # ignores the stop event
    group.spawn("polite", lambda: group.stop.wait(30.0))
    t0 = time.monotonic()
    assert group.join(timeout=0.2) == ["stubborn"]
    assert time.monotonic() - t0 < 5.0
    release.set()
    group.check()  # nobody failed
