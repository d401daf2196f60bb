"""What machine a benchmark ran on, recorded in every bench's JSON line (`emit`).

Why: the shared CPU machine these figures come from is not the same host from one day to the next.
The same 2-core kind has been an AMD EPYC with AVX2 only and a CPU with AVX-512 BF16, and the
vector instructions move the figures by more than any change measured here. For example, XLA:CPU
runs bf16 products with f32 accumulation on AVX-512 BF16 but emulates them on AVX2, and torch's
eager CPU kernels change speed relative to ours. A figure is only comparable with figures from the
same CPU, so each result names it.

Hosts report their model name loosely ("AMD EPYC" for several generations), so the description also
carries the vendor's family/model/stepping numbers and the cache sizes: AMD family 25 is Zen 3/4,
family 26 is Zen 5, and the figures differ between them.
"""

from __future__ import annotations

import json
import os
import platform
from typing import Optional

# The instruction-set features that change which kernels XLA:CPU and torch pick (bf16, AMX, AVX-512).
ISA_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


# /proc/cpuinfo keys of the first processor kept verbatim in the description (absent keys are left out).
_IDENTITY = {"vendor_id": "vendor", "cpu family": "family", "model": "model", "stepping": "stepping"}


def _cpuinfo(path: str) -> tuple[Optional[str], set[str], dict]:
    """(model name, flags, identity) of the first processor in a /proc/cpuinfo-format file, where
    identity holds the _IDENTITY keys it has; (None, {}, {}) if unreadable."""
    model, flags, ident = None, set(), {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key:  # a blank line ends the first processor's block
                    if model is not None or flags:
                        break
                elif key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                elif key in _IDENTITY and _IDENTITY[key] not in ident:
                    ident[_IDENTITY[key]] = value.strip()
    except OSError:
        pass
    return model, flags, ident


def _caches(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> dict:
    """{'L1d': '48K', 'L2': '1024K', 'L3': '32768K', ...} of cpu0 from sysfs; {} where unreadable."""
    out = {}
    try:
        entries = sorted(os.listdir(sysfs))
    except OSError:
        return out
    for entry in entries:
        try:
            with open(os.path.join(sysfs, entry, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(sysfs, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(sysfs, entry, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        out[name] = size
    return out


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all of the machine's where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def describe(cpuinfo_path: str = "/proc/cpuinfo", cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> dict:
    """{'cpu': model name, 'cores': usable cores, 'isa': the ISA_FEATURES this CPU has, 'load_avg': now,
    'id': {vendor, family, model, stepping} as /proc/cpuinfo gives them, 'caches': {'L2': '1024K', ...}}."""
    model, flags, ident = _cpuinfo(cpuinfo_path)
    return {"cpu": model or platform.processor() or platform.machine(), "cores": usable_cores(),
            "isa": [f for f in ISA_FEATURES if f in flags],
            "load_avg": [round(x, 2) for x in os.getloadavg()], "id": ident, "caches": _caches(cache_dir)}


def summary_line(info: dict) -> str:
    """One line for a bench's printed header:
    'machine: AMD EPYC (family 26 model 2), 2 cores, avx2 fma ...; L2 1024K, L3 32768K; load average ...'."""
    isa = " ".join(info["isa"]) or "no AVX2"
    ident = info.get("id") or {}
    fam = f" (family {ident['family']} model {ident.get('model', '?')})" if "family" in ident else ""
    caches = ", ".join(f"{k} {v}" for k, v in (info.get("caches") or {}).items() if k in ("L2", "L3"))
    return (f"machine: {info['cpu']}{fam}, {info['cores']} cores, {isa}" + (f"; {caches}" if caches else "")
            + f"; load average {info['load_avg']}")


def emit(result: dict) -> dict:
    """Print a bench's result as its last line, one JSON object, with the machine it ran on."""
    result = {**result, "machine": describe()}
    print(json.dumps(result), flush=True)
    return result
