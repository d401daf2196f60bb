"""The python sandbox stops and reports runaway code (loopback only); bubblewrap by default, the
audit-hook mode only when asked for; no bwrap, no python environment (tests/env/test_sandbox_attacks.py
holds the escapes)."""

import logging
import os
import socket
import threading

import pytest

from laminar_jax.env import Environment, StepResult, make_env, register_env
from laminar_jax.env import bwrap
from laminar_jax.env.config import EnvSection
from laminar_jax.env.driver import EpisodeDriver
from laminar_jax.env.sandbox import SCRATCH, SandboxLimits, Scratch, run_python

LIMITS = SandboxLimits(cpu_s=2, memory_bytes=512 << 20, wall_s=4.0)
_PROBLEM = bwrap.sandbox_problem()
needs_bwrap = pytest.mark.skipif(_PROBLEM is not None, reason=f"no usable bubblewrap: {_PROBLEM}")
BOTH = pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "none"])


@pytest.fixture()
def scratch():
    s = Scratch()
    yield s.path
    s.close()


@BOTH
def test_plain_code_runs_in_its_scratch_dir(scratch, mode):
    r = run_python("import os\nopen('out.txt', 'w').write('hi')\nprint(6 * 7, os.getcwd())", scratch, LIMITS, mode)
    assert r.status == "ok", r
    assert r.stdout.split() == ["42", SCRATCH if mode == "bwrap" else scratch]
    assert open(os.path.join(scratch, "out.txt")).read() == "hi"


@BOTH
def test_infinite_loop_hits_the_cpu_limit(scratch, mode):
    # A wall limit far above the CPU limit: on a loaded machine 2 CPU-seconds can take 4 s of wall.
    limits = SandboxLimits(cpu_s=1, memory_bytes=512 << 20, wall_s=30.0)
    r = run_python("while True:\n    pass", scratch, limits, mode)
    assert r.status == "cpu_limit" and r.wall_s < limits.wall_s, r


@needs_bwrap
def test_sleeping_code_hits_the_wall_limit(scratch):
    r = run_python("import time\ntime.sleep(60)", scratch, SandboxLimits(cpu_s=2, wall_s=1.0))
    assert r.status == "wall_limit" and r.wall_s < 5, r


@needs_bwrap
def test_ten_gigabytes_are_refused(scratch):
    r = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", scratch, LIMITS)
    assert r.status == "memory_limit" and "allocated" not in r.stdout, r


@needs_bwrap
def test_a_fork_bomb_meets_the_process_cap(scratch):
    code = ("import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
            "            time.sleep(5)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(n, e.errno)")
    r = run_python(code, scratch, LIMITS._replace(max_processes=8))
    # 8 tasks of the sandbox's uid in all (bwrap's init is one of them when not root), then EAGAIN
    assert r.status == "ok" and r.stdout.split()[1] == "11" and 6 <= int(r.stdout.split()[0]) <= 7, r


@needs_bwrap
def test_endless_output_is_stopped_and_only_its_tail_kept(scratch):
    r = run_python("import itertools\nfor i in itertools.count():\n    print(i)", scratch,
                   LIMITS._replace(output_bytes=1 << 20, output_chars=100))
    assert r.status == "output_limit" and len(r.stdout) == 100, r


@needs_bwrap
def test_subprocesses_run_inside_the_sandbox(scratch):
    code = "import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'import os; print(os.getppid())'], " \
           "capture_output=True, text=True).stdout)"
    r = run_python(code, scratch, LIMITS)
    assert r.status == "ok" and int(r.stdout) < 10, r  # its parent is a pid of the sandbox's own namespace


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(_accept(srv)), daemon=True)
    t.start()
    return srv, t, accepted


def _accept(srv):
    try:
        return srv.accept()
    except OSError:
        return None


@BOTH
def test_connect_to_loopback_port_fails(scratch, mode):
    srv, t, accepted = _listener()
    port = srv.getsockname()[1]
    r = run_python(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
                   scratch, LIMITS, mode)
    t.join(timeout=5)
    srv.close()
    assert "connected" not in r.stdout and accepted == [None], r
    if mode == "none":
        assert r.status == "denied" and r.detail.startswith("network"), r
    else:  # the sandbox's own loopback: nothing listens there
        assert r.status == "error" and "ConnectionRefused" in r.detail, r


@BOTH
@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_write_outside_the_scratch_dir_is_refused(scratch, tmp_path, target, mode):
    path = str(tmp_path / "escape.txt") if target == "absolute" else "../escape-sandbox.txt"
    r = run_python(f"open({path!r}, 'w').write('x')", scratch, LIMITS, mode)
    if mode == "none":
        assert r.status == "denied" and "outside the scratch dir" in r.detail, r
    else:  # the path does not exist in the sandbox, and / is read-only
        assert r.status == "error" and ("FileNotFoundError" in r.detail or "Read-only" in r.detail), r
    assert not os.path.exists(tmp_path / "escape.txt")
    assert not os.path.exists(os.path.join(os.path.dirname(scratch), "escape-sandbox.txt"))


def test_unsandboxed_mode_refuses_subprocesses(scratch):
    r = run_python("import subprocess\nsubprocess.run(['true'])", scratch, LIMITS, "none")
    assert r.status == "denied" and r.detail.startswith("process"), r


@needs_bwrap
def test_python_env_reports_the_limit_to_the_policy():
    env = make_env("python", cpu_s=1, wall_s=30.0)  # 1 CPU-second can take many wall seconds on a loaded machine
    env.reset({"ground_truth": 45})
    try:
        call = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
        obs, reward, done = env.step(call % "while 1: pass")
        assert "cpu_limit" in obs and reward == 0.0 and not done
        obs, _, _ = env.step(call % "print(sum(range(10)))")
        assert obs == "45"
        assert env.step("The answer is 45.") == (None, 1.0, True)
        assert [r.status for r in env.runs] == ["cpu_limit", "ok"]
        scratch = env.scratch.path
    finally:
        env.close()
    assert not os.path.exists(scratch)


def test_without_bwrap_the_python_env_refuses_to_start_and_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    with pytest.raises(bwrap.SandboxUnavailable, match=r"apt-get install bubblewrap.*env.sandbox='none'"):
        make_env("python")
    env = make_env("python", sandbox="none")  # the explicit setting runs it unsandboxed
    assert env.sandbox == "none"
    with pytest.raises(ValueError, match="sandbox='docker'"):
        make_env("python", sandbox="docker")


def test_the_run_checks_the_sandbox_before_any_episode(monkeypatch, caplog):
    from laminar_jax.runtime.rollout_worker import check_env_sandbox

    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    with pytest.raises(bwrap.SandboxUnavailable, match="apt-get install bubblewrap"):
        check_env_sandbox(EnvSection(enabled=True, default="python"))
    check_env_sandbox(EnvSection(enabled=True, default="calculator"))  # nothing that runs code: no bwrap needed
    with caplog.at_level(logging.WARNING):
        check_env_sandbox(EnvSection(enabled=True, default="python", sandbox="none"))
    assert "UNSANDBOXED" in caplog.text
    with pytest.raises(ValueError, match=r"env\.sandbox"):
        EnvSection(sandbox="off").validate("env")


class FakeSandboxedEnv(Environment):
    """Records the sandbox it was built with (a fake: no code runs)."""

    def __init__(self, sandbox: str = "bwrap"):
        self.sandbox = sandbox

    def step(self, action_text):
        return StepResult(None, 0.0, True)


register_env("fake-sandboxed", FakeSandboxedEnv)


class FakePool:
    def __init__(self):
        self.calls = []

    def submit(self, fn, *args):
        self.calls.append((fn, args))


def test_a_record_cannot_turn_the_sandbox_off():
    pool = FakePool()
    driver = EpisodeDriver(pool, tokenizer=None, sandbox="bwrap")
    req = type("Req", (), {"uid": "q0/0"})()
    driver.start(req, {"extra_info": {"env": "fake-sandboxed", "env_kwargs": {"sandbox": "none"}}})
    (_, (factory, name, _record)), = pool.calls
    assert name == "fake-sandboxed" and factory().sandbox == "bwrap"


def test_a_run_that_closes_its_output_and_lingers_is_stopped_as_an_error(scratch):
    # Unsandboxed, where -9 would otherwise read as the CPU limit's kill (bwrap holds the pipes: wall limit).
    r = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)", scratch, LIMITS, "none")
    assert r.status == "error" and "kept running" in r.detail and r.wall_s < 4, r
