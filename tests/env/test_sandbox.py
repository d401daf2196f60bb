"""The python sandbox stops and reports runaway or escaping code (loopback only)."""

import os
import socket
import threading

import pytest

from laminar_jax.env import make_env
from laminar_jax.env.sandbox import SandboxLimits, Scratch, run_python

LIMITS = SandboxLimits(cpu_s=2, memory_bytes=512 << 20, wall_s=4.0)


@pytest.fixture()
def scratch():
    s = Scratch()
    yield s.path
    s.close()


def test_plain_code_runs_in_its_scratch_dir(scratch):
    r = run_python("import os\nopen('out.txt', 'w').write('hi')\nprint(6 * 7, os.getcwd())", scratch, LIMITS)
    assert r.status == "ok", r
    assert r.stdout.split() == ["42", scratch]
    assert open(os.path.join(scratch, "out.txt")).read() == "hi"


def test_infinite_loop_hits_the_cpu_limit(scratch):
    # A wall limit far above the CPU limit: on a loaded machine 2 CPU-seconds can take 4 s of wall.
    limits = SandboxLimits(cpu_s=1, memory_bytes=512 << 20, wall_s=30.0)
    r = run_python("while True:\n    pass", scratch, limits)
    assert r.status == "cpu_limit" and r.wall_s < limits.wall_s, r


def test_sleeping_code_hits_the_wall_limit(scratch):
    r = run_python("import time\ntime.sleep(60)", scratch, SandboxLimits(cpu_s=2, wall_s=1.0))
    assert r.status == "wall_limit" and r.wall_s < 5, r


def test_ten_gigabytes_are_refused(scratch):
    r = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", scratch, LIMITS)
    assert r.status == "memory_limit" and "allocated" not in r.stdout, r


def test_connect_to_loopback_port_is_refused(scratch):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(_accept(srv)), daemon=True)
    t.start()
    port = srv.getsockname()[1]
    r = run_python(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
                   scratch, LIMITS)
    t.join(timeout=5)
    srv.close()
    assert r.status == "denied" and r.detail.startswith("network"), r
    assert "connected" not in r.stdout and accepted == [None]


def _accept(srv):
    try:
        return srv.accept()
    except OSError:
        return None


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_write_outside_the_scratch_dir_is_refused(scratch, tmp_path, target):
    path = str(tmp_path / "escape.txt") if target == "absolute" else "../escape-sandbox.txt"
    r = run_python(f"open({path!r}, 'w').write('x')", scratch, LIMITS)
    assert r.status == "denied" and "outside the scratch dir" in r.detail, r
    assert not os.path.exists(tmp_path / "escape.txt")
    assert not os.path.exists(os.path.join(os.path.dirname(scratch), "escape-sandbox.txt"))


def test_subprocess_is_refused(scratch):
    r = run_python("import subprocess\nsubprocess.run(['true'])", scratch, LIMITS)
    assert r.status == "denied" and r.detail.startswith("process"), r


def test_python_env_reports_the_limit_to_the_policy():
    env = make_env("python", cpu_s=1, wall_s=3.0)
    env.reset({"ground_truth": 45})
    try:
        obs, reward, done = env.step('<tool_call>{"name": "python", "arguments": {"code": "while 1: pass"}}</tool_call>')
        assert "cpu_limit" in obs and reward == 0.0 and not done
        obs, _, _ = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>')
        assert obs == "45"
        assert env.step("The answer is 45.") == (None, 1.0, True)
        assert [r.status for r in env.runs] == ["cpu_limit", "ok"]
        scratch = env.scratch.path
    finally:
        env.close()
    assert not os.path.exists(scratch)
