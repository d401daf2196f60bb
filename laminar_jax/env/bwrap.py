"""The bubblewrap (`bwrap`) command line that isolates model-written code (used by sandbox.py).

What the sandboxed interpreter sees:
  - its own PID, network (loopback only, and no route out), IPC, UTS and cgroup namespaces, a new
    session (no terminal to inject into) and a fresh mount namespace whose root is an empty,
    read-only tmpfs holding only
      * the interpreter binary (and libpython when it is shared), its stdlib (the base install's
        site-packages hidden under empty tmpfs mounts), the system's shared libraries
        (/usr/lib, /lib...) and /etc/ld.so.cache, all read-only;
      * /proc of its own PID namespace (no host process is visible), a minimal /dev;
      * the episode's scratch directory at /scratch, read-write (its working directory).
    No run directory, key, checkpoint, home directory or /etc/passwd is mounted.
  - --die-with-parent: the sandbox dies with the process that started it; killing bwrap kills the
    PID namespace's init, and with it every process the code left behind (setsid included).
  - a user namespace when the trainer is not root (bwrap maps the trainer's uid; RLIMIT_NPROC then
    counts the sandbox's own processes). As root, no user namespace: sandbox.py's bootstrap drops to
    the scratch directory's owner, an unused uid (the only capabilities bwrap leaves it are
    CAP_SETUID/CAP_SETGID for that drop, and no-new-privs is set), because a namespace mapped to
    host root would be exempt from RLIMIT_NPROC.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import Optional

SCRATCH = "/scratch"  # where the scratch directory appears inside the sandbox
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`), "
                "or set env.sandbox='none' to run model-written code unsandboxed (no isolation)")
_SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bwrap missing or unable to create namespaces); says how to fix it."""


def find_bwrap() -> Optional[str]:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


@functools.lru_cache(maxsize=4)
def _version(bwrap: str) -> tuple[int, ...]:
    """bwrap's version, e.g. (0, 8, 0); (0,) when it does not say."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0,)
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else (0,)


def interpreter() -> str:
    """The real interpreter binary (a venv's python is a symlink to it; the venv is not mounted)."""
    return os.path.realpath(sys.executable)


def _interpreter_mounts() -> tuple[list[str], list[str]]:
    """(read-only paths, paths to hide) for the interpreter: its binary, libpython, its stdlib."""
    # The base install's paths (in a venv, the default scheme points platstdlib into the venv).
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                     "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix})
    ro = [interpreter(), os.path.realpath(base["stdlib"]), os.path.realpath(base["platstdlib"])]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    shared = sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname
    if shared and os.path.exists(os.path.join(libdir, soname)):
        ro.append(os.path.realpath(os.path.join(libdir, soname)))
    hide = sorted({os.path.realpath(base[k]) for k in ("purelib", "platlib") if os.path.isdir(base[k])})
    return ro, hide


@functools.lru_cache(maxsize=4)
def _mount_args(exe: str) -> tuple[str, ...]:
    """The mount options for interpreter `exe` (computed once per process: they depend on the install only)."""
    ro, hide = _interpreter_mounts()
    args: list[str] = []
    system: list[str] = []
    for d in _SYSTEM_LIB_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            system.append(d)
    if os.path.isfile("/etc/ld.so.cache"):
        ro.append("/etc/ld.so.cache")
    binds = sorted(set(system + [p for p in ro if os.path.exists(p) and not _under(p, system)]))
    # bwrap creates a missing parent of a mount point 0700, which the uid the code runs as could not
    # traverse; --dir creates it 0755.
    parents = sorted({a for p in binds for a in _ancestors(p)} - set(binds) - {"/"}, key=lambda p: p.count("/"))
    for p in parents:
        if not any(_under(p, [s]) for s in binds):
            args += ["--dir", p]
    for p in binds:
        args += ["--ro-bind", p, p]
    for p in hide:
        if any(_under(p, [b]) for b in binds):
            args += ["--tmpfs", p]
    return tuple(args)


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _ancestors(path: str) -> list[str]:
    out, p = [], os.path.dirname(path)
    while p and p != "/":
        out.append(p)
        p = os.path.dirname(p)
    return out


def bwrap_argv(scratch_dir: str) -> list[str]:
    """bwrap and its options, up to (not including) the command run inside, for `scratch_dir`."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable(f"the python sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}")
    if os.geteuid() == 0:
        # No user namespace as root (see the module docstring); keep only what the uid drop needs.
        ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        ns = ["--unshare-all", "--unshare-user"]
        if _version(bwrap) >= (0, 8):  # no nested user namespaces (the option is new in 0.8)
            ns.append("--disable-userns")
    return [bwrap, *ns, "--die-with-parent", "--new-session", *_mount_args(interpreter()),
            "--proc", "/proc", "--dev", "/dev", "--bind", os.path.realpath(scratch_dir), SCRATCH,
            "--remount-ro", "/", "--chdir", "/"]


def sandbox_env() -> dict[str, str]:
    """The whole environment bwrap and the code inside get (bwrap passes its own on)."""
    return {"PATH": "/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"}


@functools.lru_cache(maxsize=4)
def _probe(bwrap: str, exe: str) -> Optional[str]:
    """None when a sandboxed interpreter starts and prints; else why not (bwrap's own words)."""
    import tempfile

    scratch = tempfile.mkdtemp(prefix="sandbox-probe-")
    try:
        cmd = bwrap_argv(scratch) + [exe, "-I", "-S", "-c", "print('sandbox-ok')"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                               env=sandbox_env())
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{bwrap} did not run: {e}"
        if r.returncode != 0 or "sandbox-ok" not in r.stdout:
            return f"{bwrap} could not start a sandbox (exit {r.returncode}): {r.stderr.strip()[-500:]}"
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def sandbox_problem() -> Optional[str]:
    """None when bwrap is installed and can isolate an interpreter here, else what is wrong and how to fix it."""
    bwrap = find_bwrap()
    if bwrap is None:
        return f"the python sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}"
    why = _probe(bwrap, interpreter())
    if why is None:
        return None
    return (f"{why}. bwrap needs permission to create namespaces (in a container: unprivileged user namespaces, or "
            "--security-opt seccomp=unconfined / --privileged); or set env.sandbox='none' to run unsandboxed")


def check_sandbox(mode: str) -> None:
    """Raise SandboxUnavailable (saying how to fix it) when `mode` is 'bwrap' and bwrap cannot isolate here."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox={mode!r}: expected one of {SANDBOX_MODES}")
    if mode == "bwrap":
        why = sandbox_problem()
        if why is not None:
            raise SandboxUnavailable(why)


SANDBOX_MODES = ("bwrap", "none")
