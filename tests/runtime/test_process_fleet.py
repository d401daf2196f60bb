"""runtime.server_processes: rollout servers as child processes of the learner's. A run loses and
repeats nothing, counts its children's CPU, and leaves no process behind: not after a clean end,
not after a SIGKILLed server, and not after its own parent is SIGKILLed."""

import os
import subprocess
import sys
import time

import pytest

from laminar_jax.benchmarks import faults
from laminar_jax.config import finalize, repo_config
from laminar_jax.configlib import ConfigError
from laminar_jax.net.auth import run_keys
from laminar_jax.runtime.process_fleet import HOST_METHODS, ChildGone, PipeBuffer, ProcessFleet, _reply

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_MODULE = b"laminar_jax.runtime.process_fleet"


def rollout_children(ppid: int) -> list[int]:
    """Live rollout processes whose parent is `ppid` (zombies have no command line: not counted)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == ppid and CHILD_MODULE in cmd:
            out.append(int(d))
    return out


def demo(run_dir: str, steps: int = 4):
    c = repo_config("demo", "short")
    c.runtime.total_steps = steps
    c.runtime.run_dir = run_dir
    c.runtime.server_processes = True
    c.runtime.progress = False
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    return c


def test_run_with_server_processes_accounts_for_every_prompt_and_reaps_its_children(tmp_path):
    from laminar_jax.runtime.local import LocalRun

    c = demo(str(tmp_path / "run"))
    run = LocalRun(finalize(c), c.runtime.run_dir)
    pids = [child.proc.pid for child in run.fleet.all]
    assert sorted(pids) == sorted(rollout_children(os.getpid())) and len(pids) == c.runtime.num_servers
    s = run.run()
    assert s["steps"] == 4 and not s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == 4 * c.runtime.prompts_per_step
    assert s["weights"]["path"] == "relay"  # no in-memory hand-off across processes
    # The servers' stats came back over the pipes (the health loop's polls), the last at the stop.
    assert sorted(run.fleet.latest) == [0, 1]
    assert sum(st["stats"]["completed"] for st in run.fleet.latest.values()) >= 4 * c.runtime.prompts_per_step
    assert run.fleet.cpu_s() > 0.0  # the children's CPU counts in the run's cores-busy figure
    assert s["cpu_cores_busy"] is not None
    assert all(child.proc.poll() is not None for child in run.fleet.all)
    assert rollout_children(os.getpid()) == []


def test_chaos_with_server_processes_sigkills_a_server_and_loses_nothing(tmp_path):
    result = faults.main(["--quick", "--server-processes", "--out", str(tmp_path),
                          "--set", "learner.compile_ahead=none"])  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    assert result["completed"] and result["killed"] == ["rollout", "relay", "learner"]
    assert result["lost_prompts"] == 0 and result["duplicated_prompts"] == 0
    assert result["consumed_prompts"] == result["expected_prompts"]
    assert result["recovery_s"]["rollout"] is not None and result["recovery_s"]["learner"] is not None
    assert rollout_children(os.getpid()) == []


def test_children_exit_when_their_parent_is_sigkilled(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), f"--config={ROOT}/configs/demo.py:short",
           f"--config.runtime.run_dir={tmp_path / 'run'}", "--config.runtime.total_steps=200",
           "--config.runtime.server_processes=true", "--config.runtime.progress=true",
           "--config.learner.compile_ahead=none"]  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline, seen = time.monotonic() + 300, []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step    1"):
                break
            assert time.monotonic() < deadline, "".join(seen[-20:])
        children = rollout_children(proc.pid)
        assert len(children) == 2, "".join(seen[-20:])
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}/cmdline") and CHILD_MODULE in open(f"/proc/{pid}/cmdline", "rb").read()
              for pid in children):
        assert time.monotonic() < deadline, f"rollout processes {children} outlived their SIGKILLed parent"
        time.sleep(0.1)


def test_a_child_that_cannot_start_says_why_and_is_not_left_running(tmp_path):
    c = demo(str(tmp_path / "run"))
    c.scheduler.heartbeat_timeout_s = 2.0  # the child's weight pull gives up after 1 s
    cfg = finalize(c)
    with pytest.raises(ChildGone, match="failed to start") as info:
        ProcessFleet(cfg, buffer=None, addresses=["127.0.0.1:1"], store_url=None,
                     keys=run_keys(str(tmp_path)).for_hosts(), timeline=None, rpc_timeout_s=10.0)
    assert "Traceback" in str(info.value)  # the child's own traceback, for the log
    assert rollout_children(os.getpid()) == []


def test_calls_outside_the_agreed_methods_are_refused_by_name():
    status, message = _reply(object(), HOST_METHODS, "a rollout host", "__init__", ())
    assert status == "error" and "'__init__'" in message
    with pytest.raises(AttributeError):
        PipeBuffer(None, 1.0).get_batch  # the learner's call, not a rollout server's


@pytest.mark.parametrize("change,field", [({"kind": "ray"}, "runtime.server_processes"),
                                          ({"profile": True}, "runtime.server_processes")])
def test_server_processes_config_errors_name_the_field(change, field):
    c = repo_config("demo", "short")
    c.runtime.server_processes = True
    for k, v in change.items():
        setattr(c.runtime, k, v)
    with pytest.raises(ConfigError, match=field):
        finalize(c)



def test_stats_failure_judges_an_answer_the_one_way_both_remote_fleets_do():
    """Pure logic (no process): a dead loop carries the worker's traceback; a stale heartbeat asks
    for the stacks and carries them, or says why it could not get them; a fresh one is healthy."""
    from laminar_jax.runtime.fleet import stats_failure

    def stacks_unreachable():
        raise TimeoutError("no answer")

    assert stats_failure("rollout process a", {"error": "", "beat_age": 1.0}, 5.0, stacks_unreachable) is None
    err, tb = stats_failure("rollout process a", {"error": "Traceback: boom", "beat_age": 0.0}, 5.0, str)
    assert isinstance(err, RuntimeError) and "rollout process a: worker loop died" in str(err) and tb == "Traceback: boom"
    err, tb = stats_failure("rollout actor b", {"error": "", "beat_age": 9.5}, 5.0, lambda: "stuck in step")
    assert isinstance(err, TimeoutError) and "no heartbeat for 9.5s" in str(err) and "heartbeat_timeout_s=5.0" in str(err)
    assert tb == "stuck in step"
    _, tb = stats_failure("rollout actor b", {"error": "", "beat_age": 9.5}, 5.0, stacks_unreachable)
    assert tb.startswith("(no stacks:") and "no answer" in tb
