"""The python sandbox's cgroup holds the whole sandbox (every process in it together) to its memory,
process-count and CPU limits, and is gone after each run with everything that was in it."""

import os
import subprocess
import sys

import pytest

from laminar_jax.env import bwrap
from laminar_jax.env.cgroup import SandboxCgroup, find_layout, join_argv, sandbox_limits
from laminar_jax.env.sandbox import SandboxLimits, Scratch, run_python

_PROBLEM = bwrap.sandbox_problem()
_LAYOUT, _WHY = find_layout()
pytestmark = [pytest.mark.skipif(_PROBLEM is not None, reason=f"no usable bubblewrap: {_PROBLEM}"),
              pytest.mark.skipif(_LAYOUT is None, reason=f"no cgroup can be made here: {_WHY}")]

# Six children of ~64 MiB each: every one is far below the per-process limit, all of them above the total.
SIX_CHILDREN = """
import os, time
kids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        b = bytearray(64 << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
print('all done', [os.waitpid(p, 0)[1] for p in kids])
"""
LIMITS = SandboxLimits(cpu_s=2, memory_bytes=192 << 20, wall_s=8.0)


@pytest.fixture()
def scratch():
    s = Scratch()
    yield s.path
    s.close()


def _runs_cgroups() -> set:
    """This process's runs' cgroups (other test processes may be making theirs meanwhile)."""
    mine = f"{os.getpid()}-"
    return {(c, n) for c, p in _LAYOUT.parents.items() for n in os.listdir(p)
            if n.startswith(mine) and os.path.isdir(os.path.join(p, n))}


def test_sandbox_limits_names_the_cgroup_version():
    assert sandbox_limits() == f"cgroup v{_LAYOUT.version}"


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "rlimits_only"])
def test_memory_is_a_total_for_the_whole_sandbox(scratch, cgroup):
    # CPU is not what this tests: paging 384 MiB in, and the cgroup's reclaim near its limit, cost
    # ~2 CPU s on a loaded 2-core host, which let the CPU watch win the race with the OOM kill.
    r = run_python(SIX_CHILDREN, scratch, LIMITS._replace(cgroup=cgroup, cpu_s=10, wall_s=20.0))
    if cgroup:
        assert r.status == "memory_limit" and "whole sandbox > 192 MiB" in r.detail, r
        assert "all done" not in r.stdout, r
    else:  # the gap the cgroup closes: per-process limits let 6 x 64 MiB through a "192 MiB" sandbox
        assert r.status == "ok" and "all done" in r.stdout, r


def test_a_fork_bomb_stays_within_the_total_process_count(scratch):
    # Every process forks as fast as it can; the first one counts the namespace's processes (its
    # /proc) at the peak. pids.max = max_processes + bwrap's 2, of which the namespace sees its init.
    code = ("import os, time\ndef bomb(depth):\n    for _ in range(50):\n        try:\n            pid = os.fork()\n"
            "        except OSError:\n            break\n        if pid == 0:\n            if depth < 3:\n"
            "                bomb(depth + 1)\n            time.sleep(3)\n            os._exit(0)\n"
            "bomb(0)\ntime.sleep(0.5)\nprint(sum(p.isdigit() for p in os.listdir('/proc')))")
    r = run_python(code, scratch, LIMITS._replace(max_processes=12, memory_bytes=512 << 20))
    assert r.status == "ok", r
    assert int(r.stdout.split()[0]) == 12 + 1, r  # the code's 12 and bwrap's init


def test_the_cgroup_alone_caps_processes():
    # No rlimit at all here (root, no RLIMIT_NPROC): pids.max by itself stops the forks.
    cg = SandboxCgroup.create(_LAYOUT, memory_bytes=256 << 20, pids=5, cpus=1.0)
    try:
        code = ("import os, time\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n"
                "            time.sleep(2)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                "    print(n, e.errno)")
        r = subprocess.run(join_argv(cg.procs, [sys.executable, "-I", "-S", "-c", code]), capture_output=True,
                           text=True, timeout=30)
        assert r.stdout.split() == ["4", "11"], r  # 5 in all: the python process and 4 children, then EAGAIN
    finally:
        assert cg.close()
    assert not any(os.path.exists(d) for d in cg.dirs.values())


def test_cpu_is_a_total_for_the_whole_sandbox(scratch):
    # Four busy processes, each under its own 2 s RLIMIT_CPU: stopped at 2 CPU-seconds in all.
    code = ("import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass")
    r = run_python(code, scratch, LIMITS._replace(cpu_s=1, cpus=4.0, wall_s=30.0))
    assert r.status == "cpu_limit" and "whole sandbox" in r.detail, r


def test_no_cgroup_and_no_process_outlives_a_run(scratch):
    marker = f"lingering-{os.getpid()}"
    before = _runs_cgroups()
    code = ("import subprocess, sys\nfor _ in range(3):\n    subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)', '{marker}'], start_new_session=True)\nprint('started', flush=True)")
    # Ending by itself, and stopped at the wall limit.
    for tail, limits in (("", LIMITS), ("\nimport time\ntime.sleep(60)", LIMITS._replace(wall_s=1.0))):
        r = run_python(code + tail, scratch, limits)
        assert r.status == ("ok" if not tail else "wall_limit") and "started" in r.stdout, r
        assert _runs_cgroups() == before == set()
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    left.append(pid)
            except OSError:
                pass
        assert not left


def test_the_host_survives_the_sandbox_running_out_of_memory(tmp_path):
    # The host, in its own process: it is not in the run's cgroup, so the OOM kill stays in the sandbox.
    script = ("import sys\nfrom laminar_jax.env.sandbox import SandboxLimits, Scratch, run_python\n"
              "s = Scratch()\nr = run_python(sys.stdin.read(), s.path, SandboxLimits(memory_bytes=192 << 20))\n"
              "s.close()\nprint('host alive', r.status)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", script], input=SIX_CHILDREN.replace("range(6)", "range(12)"),
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["host", "alive", "memory_limit"], r


def test_the_run_summary_names_how_the_limits_hold():
    from types import SimpleNamespace

    from laminar_jax.env.config import EnvSection
    from laminar_jax.monitor.sink import _env_sandbox

    assert _env_sandbox(SimpleNamespace(env=EnvSection(enabled=True))) == {
        "env_sandbox": "bwrap", "env_sandbox_limits": f"cgroup v{_LAYOUT.version}"}
    assert _env_sandbox(SimpleNamespace(env=EnvSection(enabled=True, sandbox="none"))) == {"env_sandbox": "none"}


def test_the_cgroups_of_a_killed_host_are_removed_by_the_next():
    from laminar_jax.env.cgroup import _reap_stale

    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    dirs = {c: os.path.join(p, f"{dead.pid}-stale") for c, p in _LAYOUT.parents.items()}
    for d in dirs.values():
        os.mkdir(d)
    mine = SandboxCgroup.create(_LAYOUT, memory_bytes=64 << 20, pids=4, cpus=1.0)  # a live host's: kept
    try:
        _reap_stale(_LAYOUT)
        assert not any(os.path.exists(d) for d in dirs.values())
        assert all(os.path.isdir(d) for d in mine.dirs.values())
    finally:
        assert mine.close()


def test_v2_layout_and_limits_on_a_fake_cgroup_tree(tmp_path):
    # Pure logic on plain files standing in for a cgroup2 tree (fakes: no kernel behind them).
    from laminar_jax.env.cgroup import Layout, _v2_layout

    base = tmp_path / "sys" / "trainer.service"
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mounts = [("cgroup2", str(tmp_path / "sys"), "/", set())]
    layout, why = _v2_layout(mounts, {"": "/trainer.service"})
    assert why == "" and layout == Layout(2, {"": str(base / "laminar_sandbox")})
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    run = base / "laminar_sandbox" / "r"
    run.mkdir()
    for name in ("memory.swap.max", "memory.oom.group", "cpu.max"):
        (run / name).write_text("")
    SandboxCgroup(layout, {"": str(run)})._set(192 << 20, 34, 1.5)
    got = {p.name: p.read_text() for p in run.iterdir()}
    assert got == {"memory.max": str(192 << 20), "memory.swap.max": "0", "memory.oom.group": "1",
                   "pids.max": "34", "cpu.max": "150000 100000"}
    (base / "cgroup.controllers").write_text("cpu io\n")
    assert "memory and pids controllers not available" in _v2_layout(mounts, {"": "/trainer.service"})[1]
