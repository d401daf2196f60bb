"""Reward registries for RewardPool tests: scorers that misbehave on request (loaded by worker processes)."""

import os
import time

from laminar_jax.data.rewards import RewardRegistry, default_registry


def _echo(response, ground_truth, extra_info):
    return float(response)


def _raise(response, ground_truth, extra_info):
    raise RuntimeError("scorer exploded on purpose")


def _hang(response, ground_truth, extra_info):
    time.sleep(float(extra_info.get("sleep_s", 3600)))
    return 1.0


def _crash(response, ground_truth, extra_info):
    os._exit(13)


def _nan(response, ground_truth, extra_info):
    return float("nan")


def _pid(response, ground_truth, extra_info):
    return float(os.getpid())


def _huge(response, ground_truth, extra_info):
    return float(response)  # e.g. "1e300": finite in float64, inf in float32


def _gil_hog(response, ground_truth, extra_info):
    import re

    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking inside C, holding the GIL
    return 1.0


def registry() -> RewardRegistry:
    reg = default_registry()
    for name, fn in [("huge", _huge), ("gil_hog", _gil_hog), ("echo", _echo), ("raise", _raise), ("hang", _hang), ("crash", _crash), ("nan", _nan), ("pid", _pid)]:
        reg.register_reward(name, fn)
    return reg


def not_a_registry():
    return 42
