"""Reward functions keyed by ``data_source``: an explicit registry object, built by a factory.

A reward fn is ``fn(response_text: str, ground_truth, extra_info: dict) -> float``. Lookup order:
exact name, then the longest registered prefix (e.g. ``"reasoning_gym/"``), then the default.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from typing import Any, Callable, Optional

from laminar_jax.data import synthetic_skew
from laminar_jax.data.reasoning_gym_task import PREFIX as RG_PREFIX
from laminar_jax.data.reasoning_gym_task import ReasoningGymScorer

RewardFn = Callable[[str, Any, Any], float]

MATH_SOURCES = (
    "math",
    "gsm8k",
    "openai/gsm8k",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "BytedTsinghua-SIA/DAPO-Math-17k",
)


class RewardRegistry:
    """Maps data_source names (or prefixes) to reward fns, with an optional default."""

    def __init__(self, default: Optional[RewardFn] = None):
        self._exact: dict[str, RewardFn] = {}
        self._prefix: dict[str, RewardFn] = {}
        self.default = default
        self._warm_ups: list[Callable[[], Any]] = []
        self._warm_lock, self._warm = threading.Lock(), False

    def register_reward(self, name: str, fn: RewardFn, *, prefix: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"reward for {name!r} must be callable, got {fn!r}")
        (self._prefix if prefix else self._exact)[name] = fn

    def register_warm_up(self, fn: Callable[[], Any]) -> None:
        """``fn()`` runs once before the first score: it pays a scorer's import and first-call cost
        (math_verify's is ~1 s, more on a loaded host) outside any per-reward deadline."""
        if not callable(fn):
            raise TypeError(f"warm-up must be callable, got {fn!r}")
        self._warm_ups.append(fn)

    def warm_up(self) -> list[str]:
        """Run the warm-ups once (later calls return at once); the errors they raised, as text.
        A failed warm-up is not fatal: the same failure then shows on the scores it affects."""
        with self._warm_lock:
            if self._warm:
                return []
            self._warm, errors = True, []
            for fn in self._warm_ups:
                try:
                    fn()
                except Exception as e:
                    errors.append(f"warm-up {getattr(fn, '__name__', fn)!r} failed: {type(e).__name__}: {e}")
            return errors

    def get_reward_fn(self, data_source: str) -> RewardFn:
        if data_source in self._exact:
            return self._exact[data_source]
        hits = [p for p in self._prefix if data_source.startswith(p)]
        if hits:
            return self._prefix[max(hits, key=len)]
        if self.default is not None:
            return self.default
        known = sorted(self._exact) + [p + "*" for p in sorted(self._prefix)]
        raise KeyError(f"no reward function for data_source={data_source!r}; registered: {known}")

    def names(self) -> list[str]:
        return sorted(self._exact) + [p + "*" for p in sorted(self._prefix)]

    def score(self, data_source: str, response: str, ground_truth: Any, extra_info: Any) -> float:
        return float(self.get_reward_fn(data_source)(response, ground_truth, extra_info or {}))


class _DisabledTimeoutNotice(logging.Filter):
    """Drops math_verify's "Timeout is disabled ..." warning (once per module, at its first call
    without a timeout): off the main thread the timeout is off on purpose (see _math_timeout), and
    the RewardPool's per-call deadline bounds the call instead. Its other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DisabledTimeoutNotice())


def _math_timeout() -> Optional[int]:
    # math_verify's timeouts use signal.alarm, which only works in the main thread; elsewhere run
    # without its timeout and rely on the RewardPool's per-call deadline instead.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_reward(response: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if math_verify finds the response's (boxed) answer equal to the ground truth, else 0.0."""
    import math_verify

    timeout = _math_timeout()
    gt = str(ground_truth).strip()
    gold = math_verify.parse(gt if "\\boxed" in gt else f"\\boxed{{{gt}}}", parsing_timeout=timeout)
    if not gold:
        gold = math_verify.parse(f"${gt}$", parsing_timeout=timeout)
    pred = math_verify.parse(response, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if math_verify.verify(gold, pred, timeout_seconds=timeout) else 0.0


def warm_math_reward() -> None:
    """Import math_verify (sympy, the LaTeX grammar) and score once, so the first real reward
    does not spend its deadline there."""
    math_reward("\\boxed{1}", "1")


_WS = re.compile(r"\s+")


def exact_match_reward(response: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the response equals the ground truth after stripping and collapsing whitespace."""
    return 1.0 if _WS.sub(" ", response.strip()) == _WS.sub(" ", str(ground_truth).strip()) else 0.0


def default_registry() -> RewardRegistry:
    """math_verify for math sources (and as the default), reasoning-gym, exact match, synthetic_skew."""
    reg = RewardRegistry(default=math_reward)
    for name in MATH_SOURCES:
        reg.register_reward(name, math_reward)
    reg.register_reward(RG_PREFIX, ReasoningGymScorer(), prefix=True)
    reg.register_reward("exact_match", exact_match_reward)
    reg.register_reward(synthetic_skew.DATA_SOURCE, synthetic_skew.skew_reward)
    reg.register_warm_up(warm_math_reward)
    return reg


def load_registry(spec: str) -> RewardRegistry:
    """``'module:function'`` -> the registry that function returns (how worker processes get theirs)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"reward registry spec {spec!r}: must be 'module:function'")
    reg = getattr(importlib.import_module(module), attr)()
    if not isinstance(reg, RewardRegistry):
        raise TypeError(f"reward registry spec {spec!r} returned {type(reg).__name__}, not RewardRegistry")
    return reg
