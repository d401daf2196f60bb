"""Native CPU kernels, compiled from this package's C++ sources with the host's compiler on first use.

XLA:CPU has no fused paged attention, and its GEMM re-packs the weights on every call, which
costs a decode step of a few rows half its speed. ``paged_attention.cc``, ``row_products.cc`` and
``argmax.cc`` are called through the XLA FFI (``jax.ffi``; ops.py): by the ``cpu_kernel`` decode
backend (rollout/attention.py), by the engine's weight products (``rollout.weight_products``) and by
its sampling (the tokens' argmax over the vocabulary). Each shared
library is built once per source, jaxlib and CPU, with ``-march=native`` (this CPU's vector instructions), into
``$LAMINAR_JAX_NATIVE_CACHE`` (default ``~/.cache/laminar_jax/native``), and loaded from there
afterwards. The build writes a temporary file and renames it into place, so concurrent processes
never load a half-written library.

No compiler, or a failed build, is not fatal: ``available()`` says why, and callers that picked the
kernel by default fall back to the portable XLA backend (an explicit request raises the reason).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from typing import Optional

_log = logging.getLogger(__name__)

SOURCES = {"paged_attention": "paged_attention.cc", "row_products": "row_products.cc", "argmax": "argmax.cc"}
HEADERS = ("vec16.h", "parallel.h")  # included by the sources: copied beside them and part of every build key
# FFI handler symbols each library exports -> the XLA custom-call target they are registered as.
TARGETS = {"paged_attention": {"LaminarPagedAttention": "laminar_paged_attention"},
           "row_products": {"LaminarRowProducts": "laminar_row_products"},
           "argmax": {"LaminarFirstArgmax": "laminar_first_argmax"}}
CXXFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120.0


class NativeUnavailable(RuntimeError):
    """A native kernel cannot be built or loaded here (the message says why)."""


def cache_dir() -> str:
    spec = os.environ.get("LAMINAR_JAX_NATIVE_CACHE") or "~/.cache/laminar_jax/native"
    return os.path.abspath(os.path.expandvars(os.path.expanduser(spec)))


def compiler() -> Optional[str]:
    """$CXX, else the first of c++, g++, clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache dir may be shared between hosts)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines()
                     if ln.split(":")[0].strip() in ("vendor_id", "cpu family", "model", "flags")]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build_key(source: bytes, cxx: str) -> str:
    import jax.ffi

    h = hashlib.sha256(source)
    for part in (cxx, " ".join(CXXFLAGS), jax.ffi.include_dir(), _cpu_signature(), platform.machine()):
        h.update(part.encode())
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "ffi.h"), "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:20]


def build(name: str) -> str:
    """Path of the compiled library ``name`` (see SOURCES), compiling it if the cache lacks it."""
    import jax.ffi

    cxx = compiler()
    if cxx is None:
        raise NativeUnavailable("no C++ compiler found ($CXX, c++, g++ or clang++)")
    files = {f: resources.files(__package__).joinpath(f).read_bytes() for f in (SOURCES[name], *HEADERS)}
    out_dir = cache_dir()
    path = os.path.join(out_dir, f"{name}-{_build_key(b''.join(files.values()), cxx)}.so")
    if os.path.exists(path):
        return path
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise NativeUnavailable(f"cannot create the native kernel cache {out_dir} ({e}); set LAMINAR_JAX_NATIVE_CACHE")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        for fname, data in files.items():
            with open(os.path.join(tmp, fname), "wb") as f:
                f.write(data)
        src = os.path.join(tmp, SOURCES[name])
        lib = os.path.join(tmp, "lib.so")
        cmd = [cxx, *CXXFLAGS, "-I", jax.ffi.include_dir(), src, "-o", lib]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise NativeUnavailable(f"compiling {SOURCES[name]} took over {BUILD_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCES[name]} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(lib, path)  # atomic: another process sees the whole library or none
    _log.info("built native kernel %s -> %s", name, path)
    return path


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """Build (if needed), load and register library ``name``'s FFI targets for the CPU platform; once per process."""
    import jax.ffi

    lib = ctypes.CDLL(build(name))
    for symbol, target in TARGETS[name].items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


@functools.lru_cache(maxsize=None)
def available(name: str) -> Optional[str]:
    """None when library ``name`` loads here, else the reason it does not (logged once)."""
    try:
        load(name)
    except (NativeUnavailable, OSError) as e:
        _log.warning("native kernel %s unavailable: %s", name, e)
        return str(e)
    return None


__all__ = ["NativeUnavailable", "available", "build", "cache_dir", "compiler", "load"]
