"""Feed a child its stdin and read its stdout/stderr as streams, keeping only a bounded tail of each.

The output of model-written code is never held whole: each stream keeps its last `keep` bytes, and
once the two together pass `max_total` bytes (or the deadline passes) the caller is told to stop the
child. Memory used here is O(keep) whatever the child prints.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from typing import Callable, NamedTuple, Optional

_CHUNK = 1 << 16
_EXIT_GRACE_S = 0.5
_WATCH_S = 0.05  # how often `watch` is asked (a run's cgroup: an OOM kill, the CPU total)  # after the child exits: how long a descendant still holding its pipes is read


class Tail:
    """The last `keep` bytes written, and how many were written in all."""

    def __init__(self, keep: int):
        self.keep, self.total, self._buf = keep, 0, bytearray()

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self._buf += data
        if len(self._buf) > 2 * self.keep:  # trim in batches: amortized O(1) per byte
            del self._buf[:-self.keep]

    def text(self, chars: int) -> str:
        return bytes(self._buf[-self.keep:]).decode("utf-8", "replace")[-chars:]


class Captured(NamedTuple):
    stdout: Tail
    stderr: Tail
    stopped: Optional[str]  # None | "wall" (deadline passed) | "output" (more than max_total bytes) | watch's


def capture(proc: subprocess.Popen, stdin_data: bytes, deadline: float, keep: int, max_total: int,
            watch: Optional[Callable[[], Optional[str]]] = None) -> Captured:
    """Pump `proc`'s pipes until both close, the deadline passes, the output passes max_total or
    `watch()` (called every _WATCH_S) returns a reason to stop.

    `proc` must have been started with stdin, stdout and stderr as pipes (bytes). Returns with the
    child possibly still running when `stopped` is set: the caller kills it.
    """
    out, err = Tail(keep), Tail(keep)
    tails = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    pending = memoryview(stdin_data)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    stopped, exited_at, next_watch = None, None, 0.0
    try:
        while any(k.fd in tails for k in sel.get_map().values()):
            now = time.monotonic()
            if now >= deadline:
                stopped = "wall"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break
            if watch is not None and now >= next_watch:
                stopped, next_watch = watch(), now + _WATCH_S
                if stopped:
                    break
            for key, _ in sel.select(timeout=min(deadline - now, 0.25 if watch is None else _WATCH_S)):
                if key.fd in tails:
                    data = _read(key.fd)
                    if data:
                        tails[key.fd].add(data)
                    elif data is not None:
                        sel.unregister(key.fd)
                else:
                    pending = _write(proc, sel, pending)
            if out.total + err.total > max_total:
                stopped = "output"
                break
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
    return Captured(out, err, stopped)


def _read(fd: int) -> Optional[bytes]:
    """The next chunk; b"" at the end of the stream; None when nothing is there yet (spurious readiness)."""
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _write(proc: subprocess.Popen, sel: selectors.BaseSelector, pending: memoryview) -> memoryview:
    """Write what the child's stdin takes now; close it once all is written (or the child stopped reading)."""
    try:
        n = os.write(proc.stdin.fileno(), pending[:_CHUNK])
        pending = pending[n:]
    except BlockingIOError:
        return pending
    except OSError:  # the child closed its stdin (or exited): the rest is not wanted
        pending = pending[:0]
    if not pending:
        sel.unregister(proc.stdin.fileno())
        proc.stdin.close()
    return pending
