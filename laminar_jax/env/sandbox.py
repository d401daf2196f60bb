"""Run untrusted, model-written Python isolated by bubblewrap, under CPU, memory, process-count,
file-size, output and wall limits, with a scratch directory as its only writable place.

sandbox="bwrap" (the default; bwrap.py says what the code can see): one `bwrap` per call, in fresh
PID, network, IPC, UTS and mount namespaces. A bootstrap inside sets the limits (soft = hard, so the
code cannot raise them) and, when the trainer is root, drops to the scratch directory's owner, an
otherwise unused uid; then it runs the code, which it read from stdin (the host never writes into
the scratch directory by path, where the code could have planted a symlink). Limits:
  - the whole sandbox, where a cgroup can be made (cgroup.py; `limits.cgroup`): bwrap and all it
    starts share one fresh cgroup per call, holding memory_bytes of memory in all (an OOM kill
    ends the run: memory_limit), max_processes (+ bwrap's two) processes and `cpus` CPUs, and the
    host stops the run past cpu_s CPU seconds in all (cpu_limit). The rlimits below hold as well;
  - CPU time: RLIMIT_CPU per process (SIGXCPU, then SIGKILL);
  - memory: RLIMIT_AS per process (an allocation past it raises MemoryError); without a cgroup,
    the whole sandbox holds at most max_processes x memory_bytes;
  - processes: RLIMIT_NPROC (threads count as processes), counted for the sandbox's own uid;
  - file size: RLIMIT_FSIZE; open files: RLIMIT_NOFILE;
  - wall time and output: the host reads stdout/stderr as streams, keeps only their last
    `output_chars`, and at `wall_s` or past `output_bytes` kills bwrap, whose PID namespace dies
    with it: every process the code started (setsid or not) is gone when run_python returns.
There is no persistent interpreter: each call is a fresh sandbox (state lives in scratch files).

sandbox="none" (only when asked for, env.sandbox='none'): the same interpreter in the trainer's own
user and namespaces, with the limits above but no process cap, and a `sys.addaudithook` hook that
refuses network, subprocesses, ctypes and writes outside scratch. It contains mistakes, not an
attacker: audit hooks live in the interpreter and are bypassable (dir_fd, _posixsubprocess, /proc).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import logging
import tempfile
import time
from typing import NamedTuple, Optional

from laminar_jax.env.bwrap import SANDBOX_MODES, SCRATCH, bwrap_argv, interpreter, sandbox_env
from laminar_jax.env.capture import capture
from laminar_jax.env.cgroup import SandboxCgroup, find_layout, join_argv

log = logging.getLogger(__name__)

# Runs first in the sandboxed interpreter: limits, the uid drop, then the code from stdin.
_LIMITS = r'''
import os, sys, resource as _r
_cpu, _mem, _fsize, _nofile, _nproc, _uid = (int(a) for a in sys.argv[1:7])
for _k, _v in ((_r.RLIMIT_CPU, (_cpu, _cpu + 1)), (_r.RLIMIT_AS, (_mem, _mem)), (_r.RLIMIT_FSIZE, (_fsize, _fsize)),
               (_r.RLIMIT_NOFILE, (_nofile, _nofile)), (_r.RLIMIT_CORE, (0, 0)), (_r.RLIMIT_NPROC, (_nproc, _nproc))):
    if _v[0] >= 0:
        _r.setrlimit(_k, _v)
_src = sys.stdin.buffer.read().decode("utf-8", "replace")
if _uid >= 0:
    os.setgroups([])
    os.setresgid(_uid, _uid, _uid)
    os.setresuid(_uid, _uid, _uid)
os.chdir(sys.argv[7])  # after the drop: the scratch dir is the sandbox uid's, mode 0700
os.environ["PWD"] = sys.argv[7]
_fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(_fd, 0)
os.close(_fd)
_code = compile(_src, "<sandbox>", "exec")
'''
_RUN = r'''
del _r, _cpu, _mem, _fsize, _nofile, _nproc, _uid, _k, _v, _src, _fd
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''
# sandbox="none" only: refuse the obvious escapes (not a security boundary, see the module docstring).
_AUDIT = r'''
scratch = os.getcwd()
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_DENY = {"socket.connect": "network", "socket.bind": "network", "socket.sendto": "network",
         "socket.sendmsg": "network", "os.system": "process", "os.fork": "process", "os.forkpty": "process",
         "os.exec": "process", "os.posix_spawn": "process", "os.spawn": "process", "subprocess.Popen": "process",
         "ctypes.dlopen": "ctypes", "ctypes.dlsym": "ctypes", "ctypes.cdata": "ctypes", "os.kill": "process"}
_write, _exit, _real, _fspath = os.write, os._exit, os.path.realpath, os.fspath

def _deny(what):
    _write(2, ("\nSANDBOX-DENIED " + what + "\n").encode("utf-8", "replace"))
    _exit(86)

def _inside(p):
    try:
        r = _real(_fspath(p))
    except Exception:
        return False
    return r == scratch or r.startswith(scratch + os.sep)

def _hook(event, args):
    if event in _DENY:
        _deny(_DENY[event] + " (" + event + ")")
    elif event == "open":
        path, mode, flags = args
        writing = (isinstance(flags, int) and flags & _W) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
        if writing and not isinstance(path, int) and not _inside(path):
            _deny("write outside the scratch dir: " + repr(path))
    elif event in _PATH_EVENTS:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                _deny("write outside the scratch dir (" + event + "): " + repr(p))

sys.addaudithook(_hook)
'''


class SandboxLimits(NamedTuple):
    cpu_s: int = 5
    memory_bytes: int = 512 << 20
    wall_s: float = 10.0
    file_bytes: int = 16 << 20
    open_files: int = 64
    output_chars: int = 4000  # of stdout and of stderr, the last ones, returned
    max_processes: int = 32  # processes and threads in the sandbox (bwrap only)
    output_bytes: int = 4 << 20  # stdout + stderr past this: the run is stopped (status output_limit)
    cpus: float = 1.0  # CPU bandwidth of the whole sandbox, in CPUs (cgroup only)
    cgroup: bool = True  # bwrap: totals for the whole sandbox through a cgroup where one can be made


class SandboxResult(NamedTuple):
    status: str  # ok | error | cpu_limit | memory_limit | wall_limit | output_limit | denied
    returncode: int
    stdout: str
    stderr: str
    detail: str  # what was denied or exceeded, "" when ok
    wall_s: float


def classify(returncode: int, stderr: str, stopped, limits: SandboxLimits) -> tuple[str, str]:
    """(status, detail) of a finished run; `stopped`: None, "wall" or "output" (capture.Captured),
    "memory" or "cpu" (the sandbox's cgroup saw an OOM kill or used more than cpu_s in all), or
    "closed" (it closed its output and was still running)."""
    if stopped == "memory":
        return "memory_limit", f"memory of the whole sandbox > {limits.memory_bytes >> 20} MiB"
    if stopped == "cpu":
        return "cpu_limit", f"CPU time of the whole sandbox > {limits.cpu_s} s"
    if stopped == "wall":
        return "wall_limit", f"wall time > {limits.wall_s} s"
    if stopped == "output":
        return "output_limit", f"output > {limits.output_bytes} bytes"
    if stopped == "closed":
        return "error", "closed stdout and stderr but kept running (stopped)"
    if "SANDBOX-DENIED " in stderr:
        return "denied", stderr.rsplit("SANDBOX-DENIED ", 1)[1].strip().splitlines()[0]
    # Killed by a signal: -N from the interpreter itself (sandbox="none"), 128+N through bwrap.
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "cpu_limit", f"CPU time > {limits.cpu_s} s"
    if "MemoryError" in stderr:
        return "memory_limit", f"address space > {limits.memory_bytes >> 20} MiB"
    if returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {returncode}"
        return "error", last
    return "ok", ""


def _sandbox_uid(scratch_dir: str) -> int:
    """As root: the uid the code runs as, the scratch dir's owner (given a fresh unused uid if it is root's)."""
    if os.geteuid() != 0:
        return -1
    st = os.stat(scratch_dir)
    if st.st_uid != 0:
        return st.st_uid
    uid = 0x60000000 + secrets.randbelow(1 << 24)  # far above login and container subuid ranges
    os.chown(scratch_dir, uid, uid)
    return uid


def _command(scratch_dir: str, limits: SandboxLimits, sandbox: str) -> tuple[list[str], str, dict]:
    """(argv, cwd, environment) of one run."""
    base = [str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes), str(limits.open_files)]
    if sandbox == "bwrap":
        args = base + [str(limits.max_processes), str(_sandbox_uid(scratch_dir)), SCRATCH]
        boot = [interpreter(), "-I", "-S", "-X", "utf8", "-c", _LIMITS + _RUN, *args]
        return bwrap_argv(scratch_dir) + boot, "/", sandbox_env()
    # No process cap: RLIMIT_NPROC would count every thread of the trainer's uid.
    args = base + ["-1", "-1", os.path.realpath(scratch_dir)]
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch_dir, "TMPDIR": scratch_dir, "LANG": "C.UTF-8"}
    return [sys.executable, "-I", "-S", "-X", "utf8", "-c", _LIMITS + _AUDIT + _RUN, *args], scratch_dir, env


def run_python(code: str, scratch_dir: str, limits: SandboxLimits = SandboxLimits(),
               sandbox: str = "bwrap") -> SandboxResult:
    """Run `code` with cwd = the scratch dir under `limits`; never raises for what the code does.

    Raises bwrap.SandboxUnavailable when sandbox='bwrap' and bwrap is not installed.
    """
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox={sandbox!r}: expected one of {SANDBOX_MODES}")
    os.makedirs(scratch_dir, exist_ok=True)
    argv, cwd, env = _command(scratch_dir, limits, sandbox)
    t0 = time.monotonic()
    cg = _cgroup(limits) if sandbox == "bwrap" else None
    got, exceeded = None, None
    try:
        watch = None if cg is None else (lambda: cg.exceeded(limits.cpu_s))
        proc = subprocess.Popen(argv if cg is None else join_argv(cg.procs, argv), cwd=cwd, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, bufsize=0)
        try:
            got = capture(proc, code.encode("utf-8", "replace"), t0 + limits.wall_s, keep=limits.output_chars * 4,
                          max_total=limits.output_bytes, watch=watch)
        finally:
            # Its output closed on its own: give the exit that usually follows a moment before killing.
            killed = _stop(proc, sandbox, grace_s=_EXIT_WAIT_S if got is not None and got.stopped is None else 0.0)
        exceeded = watch() if watch else None
    finally:
        if cg is not None:
            cg.close()
    err = got.stderr.text(limits.output_chars)
    # Still running with its output closed: stopped here, which is no CPU limit.
    # A member OOM-killed (or the CPU total passed) ends the run as that limit, even when the rest exited.
    stopped = got.stopped or exceeded or ("closed" if killed else None)
    status, detail = classify(proc.returncode, err, stopped, limits)
    return SandboxResult(status, proc.returncode, got.stdout.text(limits.output_chars), err, detail,
                         time.monotonic() - t0)


def _cgroup(limits: SandboxLimits) -> Optional[SandboxCgroup]:
    """A fresh cgroup holding the whole sandbox to `limits` (None: rlimits only, see cgroup.py)."""
    layout = find_layout()[0] if limits.cgroup else None
    if layout is None:
        return None
    try:
        # pids: the code's processes plus bwrap's two (the one started here and the namespace's init).
        return SandboxCgroup.create(layout, limits.memory_bytes, limits.max_processes + 2, limits.cpus)
    except OSError as e:
        log.warning("python sandbox: cannot create its cgroup (%s); this run has per-process rlimits only", e)
        return None


_EXIT_WAIT_S = 1.0  # from the end of its output to its exit, for a run that is ending by itself


def _stop(proc: subprocess.Popen, sandbox: str, grace_s: float) -> bool:
    """Kill what is left and reap; whether the run itself was still going after `grace_s`. bwrap:
    killing it takes its PID namespace, and all in it, along."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    running = proc.poll() is None
    if sandbox == "bwrap":
        if running:
            proc.kill()
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its session's group; a setsid()'d descendant escapes this
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    return running


class Scratch:
    """A fresh scratch directory, removed on close."""

    def __init__(self, root: str | None = None):
        self.path = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-", dir=root))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


__all__ = ["SCRATCH", "SandboxLimits", "SandboxResult", "Scratch", "classify", "run_python"]
