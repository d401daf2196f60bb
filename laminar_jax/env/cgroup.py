"""One cgroup per sandbox run: memory, process-count and CPU limits on the sandbox as a whole.

rlimits bound each process of a sandbox; a cgroup bounds all of them together. Where this process
may create cgroups (cgroup v2 with the memory and pids controllers delegated to its own cgroup, or
cgroup v1 memory and pids hierarchies it can write), every run gets a fresh cgroup under
`<own cgroup>/laminar_sandbox/`:
  - memory: memory.max (v2, with memory.swap.max=0 and memory.oom.group=1: an OOM kill takes the
    whole cgroup) or memory.limit_in_bytes (+ memory.memsw.limit_in_bytes, swappiness 0) (v1);
  - processes: pids.max (threads count);
  - CPU: a bandwidth cap (cpu.max, or cpu.cfs_quota_us / cpu.cfs_period_us) and the total CPU time
    used (cpu.stat usage_usec, or cpuacct.usage), which the host polls and stops the run past.
bwrap is started through `/bin/sh -c 'echo $$ > cgroup.procs; exec bwrap ...'`, so bwrap and all
it starts are members before any user code runs (no preexec_fn: the trainer is spawned with vfork,
not forked whole). After the run any member left is killed and the cgroup removed.

Elsewhere (no cgroup filesystem, no permission, v2 controllers not delegated) the sandbox keeps
its rlimits alone; `sandbox_limits()` says which, and why, and the reason is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import time
from typing import NamedTuple, Optional

log = logging.getLogger(__name__)

PARENT = "laminar_sandbox"  # the directory, under this process's own cgroup, holding the runs' cgroups
_PERIOD_US = 100_000
_V2_CONTROLLERS = ("memory", "pids", "cpu")
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
_V1_REQUIRED = ("memory", "pids")


class Layout(NamedTuple):
    version: int  # 2 or 1
    parents: dict  # v2: {"": parent dir}; v1: {controller: parent dir}, memory and pids at least


# Joins the cgroups whose cgroup.procs paths come before "--", then becomes the command after it.
JOIN_SH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
JOIN_FAILED = 125


def join_argv(procs: list[str], argv: list[str]) -> list[str]:
    """`argv` run as a member of the cgroups whose cgroup.procs files are `procs`."""
    return ["/bin/sh", "-c", JOIN_SH, "sh", *procs, "--", *argv]


def _mounts() -> list[tuple[str, str, str, set]]:
    """(fstype, mount point, mount root, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((rfields[0], fields[4], fields[3], set(rfields[2].split(","))))
    return out


def _own_paths() -> dict:
    """{controller: this process's cgroup path}, v2's under the key ""."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                out[c] = path
    return out


def _join(mount: str, root: str, path: str) -> str:
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return os.path.join(mount, rel.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_layout(mounts, own) -> tuple[Optional[Layout], str]:
    v2 = [(m, r) for t, m, r, _ in mounts if t == "cgroup2"]
    if not v2 or "" not in own:
        return None, "no cgroup2 mount"
    base = _join(v2[0][0], v2[0][1], own[""])
    try:
        have = open(os.path.join(base, "cgroup.controllers")).read().split()
    except OSError as e:
        return None, f"cgroup v2 at {base} unreadable: {e}"
    if not {"memory", "pids"} <= set(have):
        return None, f"cgroup v2: memory and pids controllers not available in {base} (has {have or 'none'})"
    want = " ".join("+" + c for c in _V2_CONTROLLERS if c in have)
    parent = os.path.join(base, PARENT)
    try:
        _write(os.path.join(base, "cgroup.subtree_control"), want)  # EBUSY where base itself holds processes
        os.makedirs(parent, exist_ok=True)
        _write(os.path.join(parent, "cgroup.subtree_control"), want)
    except OSError as e:
        return None, f"cgroup v2: cannot delegate {want} below {base}: {e}"
    return Layout(2, {"": parent}), ""


def _v1_layout(mounts, own) -> tuple[Optional[Layout], str]:
    parents = {}
    for c in _V1_CONTROLLERS:
        m = next(((mp, r) for t, mp, r, opts in mounts if t == "cgroup" and c in opts), None)
        if m is None or c not in own:
            continue
        parents[c] = os.path.join(_join(m[0], m[1], own[c]), PARENT)
    missing = [c for c in _V1_REQUIRED if c not in parents]
    if missing:
        return None, f"no cgroup v1 {'/'.join(missing)} hierarchy"
    try:
        for p in parents.values():
            os.makedirs(p, exist_ok=True)
    except OSError as e:
        return None, f"cgroup v1: cannot create {e.filename}: {e.strerror}"
    return Layout(1, parents), ""


@functools.lru_cache(maxsize=1)
def find_layout() -> tuple[Optional[Layout], str]:
    """(where to make the runs' cgroups, "") or (None, why none can be made); probed once, by making,
    joining and removing one cgroup."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        layout, why = None, f"cannot read /proc/self cgroup info: {e}"
    else:
        layout, why = _v2_layout(mounts, own)
        if layout is None:
            layout, why1 = _v1_layout(mounts, own)
            why = "" if layout is not None else f"{why}; {why1}"
    if layout is not None:
        why = _probe(layout)
        layout = None if why else layout
    if layout is not None:
        _reap_stale(layout)
    if layout is None:
        log.warning("python sandbox: no cgroup (%s); its memory and CPU limits are per process (rlimits)", why)
    return layout, why


def _reap_stale(layout: Layout) -> None:
    """Remove the cgroups of runs whose host process is gone (it was killed before it could)."""
    stale: dict = {}
    for c, parent in layout.parents.items():
        for name in os.listdir(parent):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and os.path.isdir(os.path.join(parent, name)) and not _alive(int(pid)):
                stale.setdefault(name, {})[c] = os.path.join(parent, name)
    for dirs in stale.values():
        SandboxCgroup(layout, dirs).close(timeout_s=1.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _probe(layout: Layout) -> str:
    """"" when a process can be put in a fresh cgroup of `layout` and the cgroup removed, else why not."""
    import subprocess

    try:
        cg = SandboxCgroup.create(layout, memory_bytes=64 << 20, pids=4, cpus=1.0)
    except OSError as e:
        return f"cgroup v{layout.version}: cannot create a cgroup: {e}"
    try:
        r = subprocess.run(join_argv(cg.procs, ["true"]), capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            return f"cgroup v{layout.version}: cannot join a cgroup: {r.stderr.strip()[-300:]}"
        return ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cgroup v{layout.version}: cannot join a cgroup: {e}"
    finally:
        if not cg.close():
            return f"cgroup v{layout.version}: cannot remove a cgroup"


def sandbox_limits() -> str:
    """How the sandbox's limits hold: 'cgroup v2', 'cgroup v1' (totals for the whole sandbox) or
    'rlimits: <why no cgroup>' (per process)."""
    layout, why = find_layout()
    return f"cgroup v{layout.version}" if layout else f"rlimits: {why}"


class SandboxCgroup:
    """One run's cgroup (one directory per v1 hierarchy)."""

    def __init__(self, layout: Layout, dirs: dict):
        self.layout, self.dirs = layout, dirs

    @classmethod
    def create(cls, layout: Layout, memory_bytes: int, pids: int, cpus: float) -> "SandboxCgroup":
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        dirs = {c: os.path.join(p, name) for c, p in layout.parents.items()}
        cg = cls(layout, {})
        try:
            for c, d in dirs.items():
                os.mkdir(d)
                cg.dirs[c] = d
            cg._set(memory_bytes, pids, cpus)
        except OSError:
            cg.close()
            raise
        return cg

    def _file(self, controller: str, name: str) -> Optional[str]:
        d = self.dirs.get("" if self.layout.version == 2 else controller)
        return None if d is None else os.path.join(d, name)

    def _set(self, memory_bytes: int, pids: int, cpus: float) -> None:
        quota = f"{max(1000, int(cpus * _PERIOD_US))}"
        if self.layout.version == 2:
            d = self.dirs[""]
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            for name in ("memory.swap.max", "memory.oom.group"):  # absent without swap accounting / on old kernels
                if os.path.exists(os.path.join(d, name)):
                    _write(os.path.join(d, name), "0" if name == "memory.swap.max" else "1")
            _write(os.path.join(d, "pids.max"), str(pids))
            if os.path.exists(os.path.join(d, "cpu.max")):
                _write(os.path.join(d, "cpu.max"), f"{quota} {_PERIOD_US}")
            return
        mem = self.dirs["memory"]
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):  # no swapping past the limit
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        try:
            _write(os.path.join(mem, "memory.swappiness"), "0")
        except OSError:
            pass
        _write(os.path.join(self.dirs["pids"], "pids.max"), str(pids))
        if "cpu" in self.dirs:
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_period_us"), str(_PERIOD_US))
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_quota_us"), quota)

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files a process writes its pid into to join (all hierarchies)."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory limit (v1 without the counter: limit hits)."""
        path = self._file("memory", "memory.events" if self.layout.version == 2 else "memory.oom_control")
        stats = _kv(path)
        if "oom_kill" in stats:
            return stats["oom_kill"]
        return 0 if self.layout.version == 2 else _int(self._file("memory", "memory.memsw.failcnt"))

    def cpu_s(self) -> Optional[float]:
        """CPU seconds used by all members so far (None: not counted here)."""
        if self.layout.version == 2:
            usec = _kv(self._file("cpu", "cpu.stat")).get("usage_usec")
            return None if usec is None else usec / 1e6
        path = self._file("cpuacct", "cpuacct.usage")
        return None if path is None else _int(path) / 1e9

    def exceeded(self, cpu_limit_s: float) -> Optional[str]:
        """'memory' (an OOM kill happened), 'cpu' (more than cpu_limit_s CPU seconds in all) or None."""
        if self.oom_kills() > 0:
            return "memory"
        used = self.cpu_s()
        return "cpu" if used is not None and used > cpu_limit_s else None

    def _members(self) -> list[int]:
        pids = set()
        for p in self.procs:
            try:
                pids.update(int(x) for x in open(p).read().split())
            except OSError:
                pass
        return sorted(pids)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Kill every member, remove the cgroup; whether it is gone (False: left, and logged)."""
        kill = self._file("", "cgroup.kill") if self.layout.version == 2 else None
        deadline = time.monotonic() + timeout_s
        while self.dirs:
            if kill and os.path.exists(kill):
                _try(lambda: _write(kill, "1"))
            for pid in self._members():
                _try(lambda: os.kill(pid, signal.SIGKILL))
            for c, d in list(self.dirs.items()):
                try:
                    os.rmdir(d)
                    del self.dirs[c]
                except FileNotFoundError:
                    del self.dirs[c]
                except OSError:  # EBUSY while a killed member is still exiting
                    pass
            if self.dirs and time.monotonic() > deadline:
                log.error("python sandbox: cgroup %s not removed within %.0f s", sorted(self.dirs.values()), timeout_s)
                return False
            if self.dirs:
                time.sleep(0.005)
        return True


def _try(fn) -> None:
    try:
        fn()
    except OSError:
        pass


def _int(path: Optional[str]) -> int:
    try:
        return int(open(path).read().split()[0]) if path else 0
    except (OSError, ValueError, IndexError):
        return 0


def _kv(path: Optional[str]) -> dict:
    """A `key value` per line stats file as {key: int}; {} when unreadable."""
    out = {}
    try:
        for line in open(path).read().splitlines() if path else ():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


__all__ = ["JOIN_FAILED", "Layout", "SandboxCgroup", "find_layout", "join_argv", "sandbox_limits"]
