"""A published version on a rollout server's side: flat host arrays -> the engine's param tree.

A version is flat (name -> array, learner/publish.py); a server's engine takes a pytree shaped like
its own (possibly abstract) params.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def host_params(flat: dict, template) -> Any:
    """Published flat weights -> a host tree shaped like ``template`` (the engine's params, possibly
    abstract). A leaf the version does not carry (a value head: publishing drops it; the engine
    never reads it) is zeros of the template's shape."""
    from laminar_jax.learner.publish import flatten_params, unflatten_params

    names = flatten_params(template, drop=())
    absent = {n: np.zeros(x.shape, x.dtype) for n, x in names.items()
              if n not in flat and isinstance(x, jax.ShapeDtypeStruct)}
    return unflatten_params({**flat, **absent} if absent else flat, template, drop=())


def params_on_device(flat: dict[str, Any], template: Any) -> Any:
    """Published flat weights -> the server's param pytree, on its device. One host->device copy
    now, instead of one per generate() call (and the relay's zero-copy views may be recycled once
    released)."""
    return jax.device_put(host_params(flat, template))
