"""Data plane: prompt pipelines (files, reasoning-gym, synthetic_skew), reward functions and the reward pool.

Names are imported lazily (PEP 562) so that reward worker processes, which only need
``laminar_jax.data.rewards``, start without importing grain.
"""

import importlib

_EXPORTS = {
    "BadRowError": "records",
    "OverlongPromptError": "records",
    "Prompt": "records",
    "DataSection": "config",
    "PromptSource": "source",
    "build_prompt_source": "source",
    "RewardPool": "reward_pool",
    "RewardResult": "reward_pool",
    "RewardRegistry": "rewards",
    "default_registry": "rewards",
    "load_registry": "rewards",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"laminar_jax.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'laminar_jax.data' has no attribute {name!r}")
