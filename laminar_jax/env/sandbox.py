"""Run untrusted Python in a subprocess with CPU-time, memory, file-size and wall limits, a scratch
directory as cwd, no network and no writes outside the scratch directory.

How each limit is enforced (Linux):
  - CPU time: RLIMIT_CPU (the kernel sends SIGXCPU, then SIGKILL);
  - memory: RLIMIT_AS (address space; an allocation past it raises MemoryError);
  - wall time: the parent kills the child's process group at `wall_s`;
  - file size: RLIMIT_FSIZE; open files: RLIMIT_NOFILE;
  - network, writes outside the scratch dir, subprocesses, ctypes: a `sys.addaudithook` hook
    installed before the code runs refuses socket connect/bind/sendto, opening for writing (and
    remove/rename/mkdir/chmod...) outside the scratch dir, fork/exec/spawn/system and ctypes;
    a refusal writes a `SANDBOX-DENIED <what>` line to stderr and ends the process at once.
What this is not: a security boundary against hostile code. Audit hooks live in the interpreter
(a C extension or a bug in CPython could bypass them) and there is no network namespace (the
machine has no `unshare` for us); it contains mistakes and runaway model-written code, the
workload of a tool-use sandbox. Run untrusted code from the internet in a container or VM.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

_BOOTSTRAP = r'''
import os, sys
scratch = os.path.realpath(sys.argv[1])
with open(sys.argv[2], encoding="utf-8") as f:
    src = f.read()
code = compile(src, "<sandbox>", "exec")
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
del f
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


class SandboxLimits(NamedTuple):
    cpu_s: int = 5
    memory_bytes: int = 512 << 20
    wall_s: float = 10.0
    file_bytes: int = 16 << 20
    open_files: int = 64
    output_chars: int = 4000


class SandboxResult(NamedTuple):
    status: str  # ok | error | cpu_limit | memory_limit | wall_limit | denied
    returncode: int
    stdout: str
    stderr: str
    detail: str  # what was denied or exceeded, "" when ok
    wall_s: float


def _limit(limits: SandboxLimits):
    def pre() -> None:
        os.setsid()  # own process group: the wall limit kills everything the code left behind
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return pre


def classify(returncode: int, stderr: str, timed_out: bool, limits: SandboxLimits) -> tuple[str, str]:
    """(status, detail) of a finished run."""
    if timed_out:
        return "wall_limit", f"wall time > {limits.wall_s} s"
    if "SANDBOX-DENIED " in stderr:
        return "denied", stderr.rsplit("SANDBOX-DENIED ", 1)[1].strip().splitlines()[0]
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit", f"CPU time > {limits.cpu_s} s"
    if "MemoryError" in stderr:
        return "memory_limit", f"address space > {limits.memory_bytes >> 20} MiB"
    if returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {returncode}"
        return "error", last
    return "ok", ""


def run_python(code: str, scratch_dir: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` with cwd = scratch_dir under `limits`; never raises for what the code does."""
    os.makedirs(scratch_dir, exist_ok=True)
    src = os.path.join(scratch_dir, ".sandbox_main.py")
    with open(src, "w", encoding="utf-8") as f:
        f.write(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch_dir, "TMPDIR": scratch_dir, "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOTSTRAP, scratch_dir, src], cwd=scratch_dir,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_limit(limits), text=True, errors="replace")
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate(timeout=10)
    status, detail = classify(proc.returncode, err, timed_out, limits)
    n = limits.output_chars
    return SandboxResult(status, proc.returncode, out[-n:], err[-n:], detail, time.monotonic() - t0)


class Scratch:
    """A fresh scratch directory, removed on close."""

    def __init__(self, root: str | None = None):
        self.path = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-", dir=root))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
