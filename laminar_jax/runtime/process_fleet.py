"""The fleet of rollout servers as child processes of the learner's (runtime.server_processes; the
Fleet interface of runtime/fleet.py).

Why: rollout servers that are threads of the learner's process share its interpreter lock and its
XLA CPU pool. On a few cores the two roles then queue for both, and each role's Python costs more
per token than it does alone. A child process has its own interpreter and its
own pool; the roles meet only where they must: work and results through the buffer service, and
weights through the relay.

Each child is a `RolloutHost` (runtime/rollout_host.py, the Ray rollout actor's body) in a fresh
interpreter (`python -m` this module; never a fork: the parent's JAX runtime and threads must not be
copied). Two socket pairs, as multiprocessing Connections, join it to this process:
  ctl  the fleet's calls to the host (warmup, start, stats, export/import, stop, ...), one at a time;
  buf  the host's calls to the buffer service, answered by a thread of this process.
Only the two processes hold a pipe's ends, so nothing else can speak on it; what crosses it is
plain data (work items, trajectories, snapshots, sequence states). Weights never cross it: the
child pulls each version from the in-process relay on loopback, authenticated with the run's key.

Lifetime: a parent that exits, normally or killed, leaves its children's control pipes at their
end, and each child then exits; `close()` asks each child to exit, then kills what is left. Every call is bounded: a call that times out marks its child broken (the health loop
replaces it), since a late answer would be taken for the next call's.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

from laminar_jax.rollout.records import ServerStats
from laminar_jax.runtime.fleet import poll_each, sample_stats, server_name, stats_failure
from laminar_jax.scheduler.loops import Failure, mark_replaced
from laminar_jax.threads import Worker

# What each side may call on the other (anything else is refused by name).
BUFFER_METHODS = frozenset({"take_work", "complete", "report", "register", "episode_record"})
HOST_METHODS = frozenset({"warmup", "start", "stats", "export_sequence", "import_sequence", "stacks",
                          "inject_crash", "stop"})


class ChildGone(RuntimeError):
    """A rollout process exited, or stopped answering and was given up on."""


class RemoteError(RuntimeError):
    """A call raised on the other side of a pipe; the message carries its traceback."""


def _reply(obj, methods: frozenset, what: str, method: str, args: tuple) -> tuple:
    """Make the call `method(*args)` on `obj`: ('ok', value), or ('error', traceback) for the caller to raise."""
    if method not in methods:
        return ("error", f"{what} has no method {method!r}")
    try:
        return ("ok", getattr(obj, method)(*args))
    except BaseException:  # noqa: BLE001 - the caller's to raise, with this traceback
        return ("error", traceback.format_exc())


class PipeBuffer:
    """The buffer service's methods as bounded calls over a child's buffer pipe (thread-safe)."""

    def __init__(self, conn, timeout_s: float):
        self._conn, self._timeout_s = conn, timeout_s
        self._lock = threading.Lock()
        self._broken: Optional[str] = None

    def __getattr__(self, method: str):
        if method not in BUFFER_METHODS:
            raise AttributeError(method)
        return functools.partial(self._call, method)

    def _call(self, method: str, *args):
        with self._lock:
            if self._broken:
                raise ChildGone(self._broken)
            self._conn.send((method, args))
            if not self._conn.poll(self._timeout_s):
                self._broken = f"no answer from the buffer service's {method}() within {self._timeout_s:.1f}s"
                raise TimeoutError(self._broken)
            status, value = self._conn.recv()
        if status == "error":
            raise RemoteError(f"the buffer service's {method}() raised:\n{value}")
        return value


def serve_buffer(conn, buffer, stop: threading.Event) -> None:
    """Answer one child's buffer calls until it closes its pipe (exits) or the fleet stops."""
    while not stop.is_set():
        try:
            if conn.poll(0.2):
                conn.send(_reply(buffer, BUFFER_METHODS, "the buffer service", *conn.recv()))
        except (EOFError, OSError):
            return  # the child is gone; the health loop reports it


def child_main(ctl, buf, cfg, index: int, generation: int, addresses: Sequence[str], store_url: Optional[str],
               keys, timeout_s: float) -> None:
    """A rollout process: build the host, say ready (or why not), answer the fleet's calls until it
    says exit or its pipe ends (the parent is gone)."""
    from laminar_jax.process_settings import apply_process_settings
    from laminar_jax.runtime.rollout_host import RolloutHost

    apply_process_settings(cfg)  # before this process's JAX starts; it inherits none of the parent's
    try:
        host = RolloutHost(cfg, index, generation, addresses, store_url, PipeBuffer(buf, timeout_s), keys)
    except BaseException:  # noqa: BLE001 - told to the parent, which reports the failed start
        ctl.send(("error", traceback.format_exc()))
        os._exit(1)
    ctl.send(("ok", host.ready()))
    serve_host(ctl, host)
    host.stop(min(10.0, timeout_s))
    # No interpreter teardown: JAX's exit handlers and the relay client's threads have nothing to
    # save, and a child must not outlive its reason to exist by blocking in them.
    os._exit(0)


def serve_host(ctl, host) -> None:
    """Answer the fleet's calls on `host` until it says exit or the pipe ends (the parent is gone)."""
    while True:
        try:
            method, args = ctl.recv()
        except (EOFError, OSError):
            return
        if method == "exit":
            return
        try:
            ctl.send(_reply(host, HOST_METHODS, "a rollout host", method, args))
        except OSError:
            return


def process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system, every thread) of a live process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()  # the name may hold spaces: fields follow its ')'
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pipe() -> tuple:
    """A connected pair: (this process's Connection, the child's end as a socket to pass by fd)."""
    mine, theirs = socket.socketpair()
    return multiprocessing.connection.Connection(mine.detach()), theirs


class Child:
    """One rollout process: its pipes, the thread serving its buffer calls, bounded calls to it.

    Started as `python -m laminar_jax.runtime.process_fleet <ctl fd> <buf fd>` (not multiprocessing's
    spawn, which would import the user's main script again in the child): its arguments arrive as
    the first message on its control pipe."""

    def __init__(self, cfg, index: int, generation: int, addresses: Sequence[str], store_url: Optional[str],
                 keys, buffer, timeout_s: float):
        self.index, self.name = index, server_name(index, generation)
        self.ctl, ctl_child = _pipe()
        buf, buf_child = _pipe()
        fds = (ctl_child.fileno(), buf_child.fileno())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH"))
                                                          if p))
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, *map(str, fds)], pass_fds=fds, env=env)
        ctl_child.close()  # the child holds its ends now: a pipe ends (EOF) when either process is gone
        buf_child.close()
        # The keys (no private key: keys.for_hosts()) travel on the pipe, never in argv or the environment.
        self.ctl.send(dict(cfg=cfg, index=index, generation=generation, addresses=tuple(addresses),
                           store_url=store_url, keys=keys, timeout_s=timeout_s))
        self._buf = buf
        self._lock = threading.Lock()
        self.broken: Optional[str] = None
        stop = threading.Event()
        self._serving = Worker(f"{self.name}-buffer", functools.partial(serve_buffer, buf, buffer, stop), stop,
                               stop_on_failure=False).start()
        self._cpu_s = 0.0
        self.info: Optional[dict] = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> Optional[int]:
        """Its exit status (-9: SIGKILLed), waiting a moment for a process whose pipe just ended."""
        try:
            return self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return None

    def ready(self, timeout: float) -> Optional[dict]:
        """Its ready() answer once it has built its server and pulled weights (None: not within `timeout`)."""
        with self._lock:
            try:
                if not self.ctl.poll(timeout):
                    if not self.alive():
                        raise EOFError
                    return None
                status, value = self.ctl.recv()
            except (EOFError, OSError):
                raise ChildGone(f"rollout process {self.name} exited while starting "
                                f"(exit code {self.exit_code()})") from None
        if status != "ok":
            raise ChildGone(f"rollout process {self.name} failed to start:\n{value}")
        self.info = value
        return value

    def call(self, method: str, *args, timeout: float):
        """method(*args) on the child's host, bounded by `timeout` seconds."""
        with self._lock:
            if self.broken:
                raise ChildGone(self.broken)
            try:
                self.ctl.send((method, args))
                if not self.ctl.poll(timeout):
                    self.broken = f"rollout process {self.name}: no answer to {method}() within {timeout:.1f}s"
                    raise TimeoutError(self.broken)
                status, value = self.ctl.recv()
            except (EOFError, OSError):
                self.broken = f"rollout process {self.name} is gone (exit code {self.exit_code()}) at {method}()"
                raise ChildGone(self.broken) from None
        if status == "error":
            raise RemoteError(f"rollout process {self.name}: {method}() raised:\n{value}")
        return value

    def cpu_s(self) -> float:
        """Its CPU seconds so far (the last reading once it has exited)."""
        now = process_cpu_s(self.proc.pid)
        if now is not None:
            self._cpu_s = max(self._cpu_s, now)
        return self._cpu_s

    def close(self, timeout: float = 10.0) -> None:
        """Ask it to exit; kill it if it has not within `timeout`; stop serving its buffer calls."""
        self.cpu_s()
        with self._lock:
            try:
                if not self.broken:
                    self.ctl.send(("exit", ()))
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self._serving.stop.set()
        self._serving.join(1.0)
        for conn in (self.ctl, self._buf):
            conn.close()

    def kill(self) -> None:
        self.cpu_s()
        if self.alive():
            self.proc.kill()
            self.proc.wait(10.0)


def _each(children: Sequence[Child], method: str, *args, timeout: float) -> list:
    """method(*args) on every child at once (their warm-ups compile side by side); answers in order."""
    if not children:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(children)) as pool:
        futures = [pool.submit(functools.partial(c.call, method, *args, timeout=timeout)) for c in children]
        return [f.result() for f in futures]


class ProcessFleet:
    """Rollout servers 0..n-1 as child processes; see the module doc."""

    def __init__(self, cfg, buffer, addresses: Sequence[str], store_url: str, keys, timeline,
                 rpc_timeout_s: float):
        self.cfg, self.buffer, self.addresses, self.store_url = cfg, buffer, list(addresses), store_url
        self.keys, self.timeline, self.rpc_timeout_s = keys, timeline, rpc_timeout_s
        n = cfg.runtime.num_servers
        self.generations = [0] * n
        self.all: list[Child] = []  # every child ever started (their CPU counts after they are gone)
        self.children: list[Optional[Child]] = []
        self.latest: dict[int, dict] = {}  # index -> last stats() answer
        self._replacing: dict[int, tuple] = {}  # index -> (child, t_fail, failure record)
        try:
            self.children = [self._spawn(i) for i in range(n)]
            for c in self.children:
                if c.ready(cfg.runtime.wait_timeout_s) is None:
                    raise TimeoutError(f"rollout process {c.name} did not start within runtime.wait_timeout_s="
                                       f"{cfg.runtime.wait_timeout_s}s (build its engine, pull its weights)")
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int) -> Child:
        c = Child(self.cfg, i, self.generations[i], self.addresses, self.store_url, self.keys, self.buffer,
                  self.rpc_timeout_s)
        self.all.append(c)
        return c

    def _live(self) -> list[Child]:
        return [c for c in list(self.children) if c is not None]

    # ------------------------------------------------------------------------------ Fleet
    @property
    def names(self) -> list[str]:
        return [c.name for c in self._live()]

    def start(self) -> None:
        _each(self._live(), "start", timeout=self.rpc_timeout_s)

    def warmup(self) -> None:
        """Every child compiles its engine's programs (each is its own process), side by side."""
        _each(self._live(), "warmup", timeout=self.cfg.runtime.wait_timeout_s)

    def snapshots(self) -> dict[int, dict]:
        out = {}
        for c in self._live():
            try:
                st = c.call("stats", timeout=self.rpc_timeout_s)
            except (ChildGone, TimeoutError, RemoteError):
                continue  # the health loop deals with it; never a source or destination
            if not st["error"]:
                out[c.index] = st
        return out

    def server_stats(self) -> list:
        return [ServerStats(**self.latest[i]["stats"]) for i in sorted(self.latest)]

    def _by_name(self, name: str) -> Optional[Child]:
        return next((c for c in self._live() if c.name == name), None)

    def export(self, name: str, uid: str, version: int):
        c = self._by_name(name)
        return None if c is None else c.call("export_sequence", uid, version, timeout=self.rpc_timeout_s)

    def import_(self, name: str, state) -> int:
        c = self._by_name(name)
        if c is None:
            raise KeyError(f"rollout process {name} is not serving (dead or replaced)")
        return c.call("import_sequence", state, timeout=self.rpc_timeout_s)

    def poll_health(self) -> list[Failure]:
        return poll_each(self.children, self._replacing, self._check_replacement, self._poll)

    def _poll(self, i: int, c: Child) -> list[Failure]:
        heartbeat_s = self.cfg.scheduler.heartbeat_timeout_s
        try:
            st = c.call("stats", timeout=heartbeat_s)
        except (ChildGone, TimeoutError, RemoteError) as e:
            return self._fail(i, e, "")
        bad = stats_failure(f"rollout process {c.name}", st, heartbeat_s, lambda: c.call("stacks", timeout=5.0))
        if bad is not None:
            return self._fail(i, *bad)
        self.latest[i] = st
        sample_stats(self.timeline, st)
        return []

    def _fail(self, i: int, error: BaseException, tb: str) -> list[Failure]:
        c, self.children[i] = self.children[i], None
        self.latest.pop(i, None)
        c.close(timeout=0.0)  # killed: a process reported dead must not go on producing
        return [Failure(i, c.name, error, tb)]

    def replace(self, i: int, record: dict, t_fail: float) -> None:
        self.generations[i] += 1
        self._replacing[i] = (self._spawn(i), t_fail, record)

    def _check_replacement(self, i: int) -> list[Failure]:
        """Install replacement i once it is ready (and start its loop); one that fails to start is
        reported as a failure of its own (the health loop tries again, within max_server_restarts)."""
        c, t_fail, record = self._replacing[i]
        try:
            info = c.ready(0.0)
        except ChildGone as e:
            del self._replacing[i]
            c.close(timeout=0.0)
            return [Failure(i, c.name, e, "")]
        if info is None:
            limit = self.cfg.runtime.wait_timeout_s
            if time.time() - t_fail > limit:
                raise TimeoutError(f"replacement rollout process {c.name} did not start within "
                                   f"runtime.wait_timeout_s={limit}s (build its engine, pull its weights)")
            return []
        del self._replacing[i]
        self.children[i] = c
        try:
            c.call("start", timeout=self.rpc_timeout_s)
        except (ChildGone, TimeoutError, RemoteError) as e:
            return self._fail(i, e, "")
        mark_replaced(record, c.name, info["version"], t_fail)
        return []

    def stop(self, timeout: float) -> list[str]:
        """Take each child's last stats, then ask it to stop its loop (bounded); the names that did not."""
        self.latest.update(self.snapshots())
        live = self._live()
        stuck = []
        with concurrent.futures.ThreadPoolExecutor(max(1, len(live))) as pool:
            futures = [pool.submit(functools.partial(c.call, "stop", timeout * 0.7, timeout=timeout)) for c in live]
            for c, f in zip(live, futures):
                try:
                    if not f.result():
                        stuck.append(c.name)
                except (ChildGone, RemoteError):
                    pass  # a dead child has nothing to stop
                except TimeoutError:
                    stuck.append(c.name)
        return stuck

    def close(self) -> None:
        for c in self.all:
            c.close()

    def cpu_s(self) -> float:
        """CPU seconds of every rollout process this fleet started (for the run's cores-busy figure)."""
        return sum(c.cpu_s() for c in self.all)

    def inject_crash(self, i: int) -> None:
        """Fault injection: child i's worker raises at its next iteration."""
        self._child(i).call("inject_crash", timeout=self.rpc_timeout_s)

    def kill(self, i: int) -> None:
        """Fault injection: SIGKILL child i (as a lost process would die)."""
        self._child(i).proc.kill()

    def _child(self, i: int) -> Child:
        if self.children[i] is None:
            raise RuntimeError(f"rollout process {i} is being replaced; no process to inject a fault into")
        return self.children[i]


if __name__ == "__main__":  # a rollout process (Child): its two pipes' fds, then its arguments on the first
    _ctl = multiprocessing.connection.Connection(int(sys.argv[1]))
    _buf = multiprocessing.connection.Connection(int(sys.argv[2]))
    try:
        _args = _ctl.recv()
    except (EOFError, OSError):
        os._exit(1)  # the parent died before it sent them
    child_main(_ctl, _buf, **_args)
