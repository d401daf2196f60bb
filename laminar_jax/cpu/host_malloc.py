"""How this process's C allocator hands host memory back to the OS (runtime.host_malloc), set once
per process by the entry point.

XLA:CPU allocates every execution's temporaries and outputs with malloc and frees them when the
execution ends. glibc serves a large block (above its mmap threshold, which tops out at 32 MB)
with a fresh mmap, and returns the free top of a heap to the OS once it exceeds the trim
threshold. Either way the next execution writes into pages the kernel must fault in and zero
again, so a process that runs many small programs spends a large share of its CPU time in the
kernel faulting in and zeroing the same buffers.

'keep' (the default) tells glibc to serve every block from its heaps (no mmap: M_MMAP_MAX = 0) and
to keep freed memory (M_TRIM_THRESHOLD at its maximum), so a step's buffers reuse the pages the
previous step faulted in; M_TOP_PAD grows a heap 64 MB at a time. The cost: the process's resident
memory stays at its peak instead of shrinking after it. What it does not cover: a thread other
than the main one allocates from its own arena, whose heaps are 64 MB at most, so glibc still maps
a larger block there directly (and may unmap a heap that empties). 'system' leaves glibc's
defaults. Other C libraries (musl, macOS) are left alone with a log line. The same policy as
environment variables, for a process this one starts (a peer in a benchmark), is
`environment("keep")`.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

_log = logging.getLogger(__name__)

POLICIES = ("keep", "system")

# mallopt() parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
_NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int: the largest trim threshold it can express
_TOP_PAD = 64 << 20

# policy -> ((mallopt parameter, value, environment variable glibc reads at start-up), ...)
_SETTINGS = {
    "keep": ((M_MMAP_MAX, 0, "MALLOC_MMAP_MAX_"), (M_TRIM_THRESHOLD, _NEVER_TRIM, "MALLOC_TRIM_THRESHOLD_"),
             (M_TOP_PAD, _TOP_PAD, "MALLOC_TOP_PAD_")),
    "system": (),
}


def _check(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"runtime.host_malloc={policy!r}: must be one of {list(POLICIES)}")


def environment(policy: str) -> dict[str, str]:
    """The policy as glibc's environment variables, for a child process (read when it starts)."""
    _check(policy)
    return {env: str(value) for _, value, env in _SETTINGS[policy]}


def _glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (the symbols already loaded: no library search)."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def apply_host_malloc(policy: str) -> bool:
    """Set this process's allocator to `policy` (see the module docstring). True when it holds;
    False (logged) when this C library is not glibc, or glibc refused a setting."""
    _check(policy)
    settings = _SETTINGS[policy]
    if not settings:
        return True
    libc = _glibc()
    if libc is None:
        _log.info("runtime.host_malloc=%r: this C library is not glibc; its allocator is left as it is", policy)
        return False
    refused = [env for param, value, env in settings if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1]
    if refused:
        _log.warning("runtime.host_malloc=%r: glibc refused %s", policy, ", ".join(refused))
        return False
    return True
