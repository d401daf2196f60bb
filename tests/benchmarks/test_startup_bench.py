"""bench startup's fresh-process import figure (laminar_jax/benchmarks/startup.py)."""

import subprocess

import pytest

from laminar_jax.benchmarks.startup import import_seconds


def test_import_seconds_times_fresh_interpreters_importing_the_runtime(monkeypatch):
    calls = []
    real_run = subprocess.run

    def counting_run(cmd, **kw):
        calls.append(cmd)
        return real_run(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", counting_run)
    s = import_seconds(repeats=2)
    assert len(calls) == 2 and calls[0][1:] == ["-c", "import laminar_jax.runtime"]
    assert 0.1 < s < 300  # a fresh interpreter importing jax takes far more than 0.1 s anywhere


def test_import_seconds_fails_loudly_when_the_import_fails(monkeypatch):
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: real_run(cmd[:2] + ["import no_such_module_here"], **kw))
    with pytest.raises(subprocess.CalledProcessError):
        import_seconds(repeats=1)
