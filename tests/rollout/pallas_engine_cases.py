"""Engines on the Pallas decode kernels (interpret mode, CPU) against the portable kernel: shared by
test_pallas_engine.py and its tensor-parallel subprocess.

A run admits ragged prompts (one inside a page, one ending on a page boundary, one over two pages,
one sharing another's prompt through share_prompt) and decodes them across page boundaries; it
returns every emitted token and log-prob per slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.model import PRESETS, Transformer
from laminar_jax.rollout import RolloutSection, kernels_gpu, kernels_tpu, make_engine
from laminar_jax.rollout.paged import SlotInit
from laminar_jax.rollout.batch_admit import share_prompt

PAGE = 8
SECTION = RolloutSection(num_slots=4, page_size=PAGE, num_pages=48, max_prompt_len=24, max_total_len=64,
                         max_new_tokens=20, prefill_buckets=(24,), stop_token_ids=())
PROMPTS = ([1, 5, 9, 14, 3], [1] + list(range(3, 3 + 2 * PAGE)), [1] + list(range(40, 40 + PAGE)))
STEPS = 14  # the shortest prompt crosses a page boundary, the longest a second one

# Interpret-mode forms of the registered kernels, named as the registry names them (tests only).
PALLAS = {"pallas_gpu_paged": lambda: kernels_gpu.make_decode(interpret=True),
          "pallas_tpu_paged": lambda: kernels_tpu.make_decode(interpret=True)}


def model(kv_heads: int, dtype, seed: int = 0) -> Transformer:
    """The tiny preset with head_dim 32 (both kernels' tiles take it in interpret mode), 4 query heads."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_heads=4, num_kv_heads=kv_heads, head_dim=32)
    return Transformer(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)


def engine(kernel: str, kv_heads: int, dtype, mesh=None, section: RolloutSection = SECTION):
    """(engine, params) running ``kernel`` ('live_pages' or a Pallas kernel in interpret mode)."""
    extra = {kernel: PALLAS[kernel]()} if kernel in PALLAS else None
    return make_engine(model(kv_heads, dtype), dataclasses.replace(section, attention_impl=kernel),
                       attention_backends=extra, mesh=mesh)


def init(i: int, temperature: float = 0.0, max_new: int = STEPS + 2, num_generated: int = 0) -> SlotInit:
    return SlotInit(np.array([7, 100 + i], np.uint32), temperature, 0, 1.0, max_new, np.zeros(0, np.int32),
                    num_generated)


def admit(eng, params, temperature: float = 0.0):
    """A fresh state with the three prompts in slots 0-2 and slot 3 sharing slot 0's prompt."""
    state = eng.init_decode_state()
    for slot, p in enumerate(PROMPTS):
        state = eng.prefill_insert(params, state, slot, p, init(slot, temperature))
    return share_prompt(eng, state, [0], [3], [PROMPTS[0]], [init(3, temperature)])


def decode(eng, params, state, steps: int):
    """(state, tokens i32[slots, steps], log-probs f32[slots, steps]) of ``steps`` generate() calls."""
    toks, lps = [], []
    for _ in range(steps):
        state, out = eng.generate(params, state)
        toks.append(np.asarray(out.tokens)[0])
        lps.append(np.asarray(out.logprobs)[0])
    return state, np.stack(toks, 1), np.stack(lps, 1)


def run(kernel: str, kv_heads: int, dtype, mesh=None, temperature: float = 0.0):
    eng, params = engine(kernel, kv_heads, dtype, mesh)
    _, toks, lps = decode(eng, params, admit(eng, params, temperature), STEPS)
    return eng, toks, lps


def move(src, dst, src_params, dst_params, src_state, slot: int):
    """Export ``slot`` from engine src (read_slot: the wire layout) and import it into a fresh state of dst
    in the same slot; (src state, dst state)."""
    src_state = src.deactivate(src_state, slot)
    n = int(jax.device_get(src_state.lengths)[slot])
    last = int(jax.device_get(src_state.last_token)[slot])
    done = int(jax.device_get(src_state.num_generated)[slot])
    k, v = src.read_slot(src_state, slot, n)
    src.free(slot)
    state = dst.write_slot(dst.init_decode_state(), slot, k, v, n, last, len(PROMPTS[slot]),
                           init(slot, max_new=STEPS + 2, num_generated=done))
    return src_state, state


def tolerance(dtype, kernel: str = "") -> float:
    """Log-prob tolerance: the TPU kernel rounds K and V to bf16 whatever the pools' dtype (kernels_tpu)."""
    return 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 or kernel == "pallas_tpu_paged" else 1e-4
