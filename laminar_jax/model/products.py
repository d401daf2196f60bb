"""How a model's weight products run: an explicit argument of its forward passes.

The model is platform-free: it never asks which backend it runs on. Whoever runs it (the learner,
the rollout engine through its kernel seam, rollout/kernels.py) picks a `Products` for its platform
(`laminar_jax/kernels.py`) and passes it to `forward` / `forward_cached` / `logits_from_hidden`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np


class Products(NamedTuple):
    """The weight products' output dtype and, optionally, a kernel for products of few rows.

    low_out: output dtype of low-precision (bf16/f16) products: float32 (they accumulate in float32
      and the result is rounded once, where it is used), or None for the compute dtype (an
      accelerator's matrix units accumulate in float32 either way, and a float32 output would make
      a learner's backward products float32 x float32). The model casts the result back to its
      compute dtype in both cases.
    kernel: (x f[M, K], w f[N, K]) -> f32[M, N] for products of at most ``kernel_rows`` rows whose
      weight has at least ``kernel_min_weights`` elements; None: every product on XLA's dot.
    """

    low_out: Any = jnp.float32
    kernel: Optional[Callable] = None
    kernel_rows: int = 0
    kernel_min_weights: int = 0

    def takes(self, x: jax.Array, w: jax.Array) -> bool:
        """Whether the product of x[..., K] with w[N, K] runs on ``kernel`` (a static decision)."""
        rows = int(np.prod(x.shape[:-1]))
        return self.kernel is not None and 0 < rows <= self.kernel_rows and w.size >= self.kernel_min_weights

    def on_kernel(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x[..., K] . w[N, K]^T through ``kernel``: f32[..., N]."""
        flat = x.reshape(-1, x.shape[-1])
        return self.kernel(flat, w).reshape(*x.shape[:-1], w.shape[0])


DEFAULT = Products()  # XLA's dot; low-precision products come out in float32
