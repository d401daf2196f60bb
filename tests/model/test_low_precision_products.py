"""bf16 weight products: on the CPU they come out in float32 (XLA:CPU's bf16 kernels), on accelerators
in bf16, so that a bf16 learner's backward products are bf16 too rather than float32 (the cotangent of
a float32 output arrives in float32 and promotes its bf16 partner). The model never asks for its
backend: the kernel seam's `train_products(platform)` picks the products, so the accelerator path is
traced here on the CPU with the GPU's choice; its gradients agree with the CPU path's to bf16 rounding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.kernels import train_products
from laminar_jax.model import PRESETS, Transformer


def _loss_and_grad(backend: str):
    products = train_products(backend)
    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    graph, params = nnx.split(model)
    tokens = (jnp.arange(2 * 24, dtype=jnp.int32).reshape(2, 24) * 7) % PRESETS["tiny"].vocab_size

    def loss(p):
        logits = nnx.merge(graph, p).forward(tokens, products=products).logits
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].max(axis=-1))

    fn = jax.jit(jax.value_and_grad(loss))
    text = fn.lower(params).as_text()
    value, grads = fn(params)
    return text, value, grads


WEIGHT_SHAPES = ("64x64x", "32x64x", "192x64x", "64x192x")  # the tiny model's q/o, k/v, gate/up, down


def _weight_product_types(text: str) -> set:
    """(lhs, rhs, out) element types of every product that takes or makes a weight of the tiny model
    ([out, in]: the forward, and the backward's input and weight gradients)."""
    kinds = set()
    for line in text.splitlines():
        m = re.search(r"stablehlo.dot_general.*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", line)
        if m and any(f"<{w}" in t for t in m.groups() for w in WEIGHT_SHAPES):
            kinds.add(tuple(t.rsplit("x", 1)[1].rstrip(">") for t in m.groups()))
    return kinds


def test_accelerator_backward_products_are_bf16_and_gradients_agree():
    cpu_text, cpu_loss, cpu_grads = _loss_and_grad("cpu")
    acc_text, acc_loss, acc_grads = _loss_and_grad("gpu")
    cpu_kinds, acc_kinds = _weight_product_types(cpu_text), _weight_product_types(acc_text)
    assert ("f32", "f32", "f32") in cpu_kinds  # the CPU's backward: float32 products
    assert acc_kinds and all(k == ("bf16", "bf16", "bf16") for k in acc_kinds), acc_kinds
    assert float(acc_loss) == pytest.approx(float(cpu_loss), rel=2e-2)
    for a, c in zip(jax.tree.leaves(acc_grads), jax.tree.leaves(cpu_grads)):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.linalg.norm(a - c) <= 0.05 * np.linalg.norm(c) + 1e-6
