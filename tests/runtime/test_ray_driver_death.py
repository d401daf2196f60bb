"""A SIGKILLed driver leaves no actor behind. Its actors are Ray actors it owns (not detached), which
Ray ends when their owner dies: on a cluster the run joined (runtime.address), and on the local
cluster a run starts for itself (whose Ray processes die with it). Checked by process listing:
within scheduler.heartbeat_timeout_s of the kill, no process of the run's actors is left."""

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.subprocess_env import child_env

pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GONE_WITHIN_S = 30.0  # scheduler.heartbeat_timeout_s's default


def _start(args, log):
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, start_new_session=True)


def _line(proc, timeout, what, want=None):
    """The next stdout line (or the first equal to `want`) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"{what}: the process exited with {proc.wait(30)} (see its log)")
            if want is None or line.strip() == want:
                return line.strip()
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _tree(root):
    """{pid: command} of `root`'s descendants (Ray's workers start their own sessions, so a process
    group would miss them; the parent links do not)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, timeout=30).stdout
    children, cmd = {}, {}
    for line in out.splitlines():
        pid, ppid, args = (line.split(None, 2) + [""])[:3]
        children.setdefault(int(ppid), []).append(int(pid))
        cmd[int(pid)] = args[:100]
    found, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            found[c] = cmd[c]
            todo.append(c)
    return found


def _actor_pids(root):
    return {p: c for p, c in _tree(root).items() if c.startswith("ray::") and c.split("::")[1].split(".")[0]
            in ("RolloutActor", "BufferService", "RelayActor")}


def _alive(pids):
    """Those of `pids` still running (a zombie waiting for its reaper has ended)."""
    out = {}
    for p, c in pids.items():
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out[p] = c
        except FileNotFoundError:
            pass
    return out


def _gone_within(pids, timeout):
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _alive(pids)


def _kill_group(proc):
    """End what this test started: the process and its session's group (by id)."""
    if proc.poll() is None:
        proc.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_cluster(port, log, temp_dir):
    """`ray start --head --block`: a cluster that outlives any driver (as a long-running one does).
    Ray 2.60's `ray start` turns its token auth on; clients use the same token (RAY_AUTH_MODE=token).
    Its own --temp-dir: `ray start` records its address there, and a plain `ray.init()` elsewhere on
    this machine (another test) would otherwise join this cluster instead of starting its own."""
    env = child_env(JAX_PLATFORMS="cpu", RAY_AUTH_MODE="token")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    proc = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "will now block" not in open(log).read():
        assert proc.poll() is None and time.monotonic() < deadline, f"ray start failed: {open(log).read()[-2000:]}"
        time.sleep(0.5)
    return proc


def _stop_cluster(proc):
    """SIGTERM: `ray start --block` stops the processes it started; then anything left of its tree."""
    tree = _tree(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    for pid in _gone_within(tree, 10):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_driver_sigkill_on_a_joined_cluster_ends_its_actors(tmp_path, monkeypatch):
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="ljray-", dir="/tmp")  # short: Ray's socket paths live under it
    cluster = _start_cluster(port, tmp_path / "cluster.log", temp_dir)
    try:
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        driver = _start(["tests.runtime.ray_driver_worker", str(tmp_path / "run"), f"127.0.0.1:{port}"],
                        tmp_path / "driver.log")
        try:
            _line(driver, 300, "the run's actors to start", want="ready")
            actors = _actor_pids(cluster.pid)  # a joined cluster's workers are its raylet's children
            kinds = " ".join(actors.values())
            assert "RolloutActor" in kinds and "BufferService" in kinds and "RelayActor" in kinds, actors
            os.kill(driver.pid, signal.SIGKILL)
            t0 = time.monotonic()
            left = _gone_within(actors, GONE_WITHIN_S)
            assert not left, f"actors still running {GONE_WITHIN_S}s after the driver was killed: {left}"
            print(f"joined cluster: {len(actors)} actors gone {time.monotonic() - t0:.1f}s after the driver's SIGKILL")
        finally:
            _kill_group(driver)
        assert cluster.poll() is None  # the cluster itself lives on: it was not the run's
    finally:
        _stop_cluster(cluster)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_driver_sigkill_with_its_own_local_cluster_leaves_no_actor(tmp_path):
    driver = _start(["tests.runtime.ray_driver_worker", str(tmp_path / "run")], tmp_path / "driver.log")
    try:
        _line(driver, 300, "the run's actors to start", want="ready")
        tree = _tree(driver.pid)
        actors = _actor_pids(driver.pid)
        assert any("RolloutActor" in c for c in actors.values()), tree
        ray_core = {p: c for p, c in tree.items() if "raylet" in c or "gcs_server" in c}
        assert ray_core, tree
        os.kill(driver.pid, signal.SIGKILL)
        t0 = time.monotonic()
        left = _gone_within({**actors, **ray_core}, GONE_WITHIN_S)
        assert not left, f"processes of the run still alive {GONE_WITHIN_S}s after the driver was killed: {left}"
        print(f"own cluster: {len(actors)} actors, raylet and GCS gone {time.monotonic() - t0:.1f}s after the "
              f"driver's SIGKILL")
    finally:
        _kill_group(driver)  # also Ray's own agent processes, which may outlive the raylet
