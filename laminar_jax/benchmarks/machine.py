"""What machine a benchmark ran on, recorded in every bench's JSON line (`emit`).

Why: the shared CPU machine these figures come from is not the same host from one day to the next.
The same 2-core kind has been an AMD EPYC with AVX2 only and a CPU with AVX-512 BF16, and the
vector instructions move the figures by more than any change measured here. For example, XLA:CPU
runs bf16 products with f32 accumulation on AVX-512 BF16 but emulates them on AVX2, and torch's
eager CPU kernels change speed relative to ours. A figure is only comparable with figures from the
same CPU, so each result names it.
"""

from __future__ import annotations

import json
import os
import platform
from typing import Optional

# The instruction-set features that change which kernels XLA:CPU and torch pick (bf16, AMX, AVX-512).
ISA_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpuinfo(path: str) -> tuple[Optional[str], set[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo-format file; (None, {}) if unreadable."""
    model, flags = None, set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model is not None and flags:
                    break
    except OSError:
        pass
    return model, flags


def describe(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """{'cpu': model name, 'cores': usable cores, 'isa': the ISA_FEATURES this CPU has, 'load_avg': now}."""
    model, flags = _cpuinfo(cpuinfo_path)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 0
    return {"cpu": model or platform.processor() or platform.machine(), "cores": cores,
            "isa": [f for f in ISA_FEATURES if f in flags],
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def summary_line(info: dict) -> str:
    """One line for a bench's printed header: 'machine: AMD EPYC, 2 cores, avx2 fma; load average ...'."""
    isa = " ".join(info["isa"]) or "no AVX2"
    return f"machine: {info['cpu']}, {info['cores']} cores, {isa}; load average {info['load_avg']}"


def emit(result: dict) -> dict:
    """Print a bench's result as its last line, one JSON object, with the machine it ran on."""
    result = {**result, "machine": describe()}
    print(json.dumps(result), flush=True)
    return result
