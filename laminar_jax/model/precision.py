"""Dtypes of weights: names, casts of a parameter tree, and the check a served version passes.

The learner trains float32 master weights (learner.master_weights), computes in `model.dtype`,
and publishes each version in the serving dtype (`rollout.dtype`); these helpers are the one
definition of "a tree in dtype d" those steps share. Only floating leaves are cast or checked:
integer leaves (none in today's models) keep their dtype.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def as_dtype(d: Any) -> np.dtype:
    """'bfloat16' / jnp.bfloat16 / np.dtype -> np.dtype (bfloat16 through ml_dtypes)."""
    return np.dtype(jnp.dtype(d))


def is_floating(x: Any) -> bool:
    return jnp.issubdtype(np.dtype(x.dtype), jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with every floating leaf in `dtype` (numpy leaves stay numpy, jax leaves jax, abstract
    leaves abstract; a leaf already in `dtype` is returned as it is, not copied). Inside a jitted
    program the cast is part of the program, and its gradient flows back to the leaf's own dtype."""
    dt = as_dtype(dtype)

    def one(x):
        if not hasattr(x, "dtype") or not is_floating(x) or np.dtype(x.dtype) == dt:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):  # abstract shapes (nnx.eval_shape) stay abstract
            return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
        return x.astype(dt)

    return jax.tree.map(one, tree)


def floating_dtypes(flat: Mapping[str, Any]) -> set[str]:
    """The dtype names of a flat {name: array} tree's floating leaves."""
    return {np.dtype(v.dtype).name for v in flat.values() if is_floating(v)}


def check_served_dtype(flat: Mapping[str, Any], dtype: Any, what: str = "weight version") -> None:
    """Raise ValueError naming the tensor and both dtypes when a floating tensor of `flat` is not in
    `dtype` (a server serves one dtype: a version in another would recompile every program and hold
    the wrong number of bytes)."""
    dt = as_dtype(dtype)
    for name, v in flat.items():
        if is_floating(v) and np.dtype(v.dtype) != dt:
            raise ValueError(f"{what}: tensor {name!r} is {np.dtype(v.dtype).name}, this server serves {dt.name} "
                             f"(rollout.dtype); publisher and servers must agree on rollout.dtype")
