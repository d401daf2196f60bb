"""XLA's GPU allocator for the run's processes: one pool of `runtime.gpu_memory_fraction` of each
GPU's memory, taken at start (XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_PREALLOCATE=true).

JAX reads both when its GPU backend starts, so every process that runs a role sets them first
(process_settings.py). The memory planner (placement_memory.py) budgets each GPU at the same
fraction, so the plan and the allocator agree on what a device can hold. CPU and TPU backends
ignore both variables.
"""

from __future__ import annotations

import os

FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


def allocator_env(fraction: float) -> dict[str, str]:
    """The environment variables that give XLA's GPU client a pool of ``fraction`` of each GPU."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"runtime.gpu_memory_fraction={fraction}: must be in (0, 1]")
    return {FRACTION_ENV: f"{fraction:.3f}", PREALLOCATE_ENV: "true"}


def apply_gpu_allocator(fraction: float) -> dict[str, str]:
    """Set this process's allocator variables (before JAX starts its GPU backend); returns them."""
    env = allocator_env(fraction)
    os.environ.update(env)
    return env
