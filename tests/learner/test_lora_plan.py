"""The memory plan's LoRA term (placement_memory.lora_items) and the published bytes per version."""

import dataclasses
import math

from laminar_jax.config import finalize, repo_config
from laminar_jax.model import lora
from laminar_jax.model.presets import PRESETS
from laminar_jax.placement_memory import lora_table, param_table, report


def _learner_items(cfg):
    r = report(cfg, "h100", 8)
    return next(row for row in r["rows"] if "learner" in row["role"])["items"]


def test_lora_table_is_the_contracts_adapters():
    got = sorted(s for s, _ in lora_table(PRESETS["tiny"], 4, lora.PROJECTIONS))
    want = sorted(lora.adapter_shapes(lora.param_shapes_of(PRESETS["tiny"]), lora.PROJECTIONS, 4).values())
    assert got == want


def test_7b_plan_counts_adapters_and_a_frozen_serving_dtype_base():
    full = finalize(repo_config("gpu_node"))
    lcfg = dataclasses.replace(full, learner=dataclasses.replace(full.learner, lora=lora.LoRASection(rank=16)))
    f, l = _learner_items(full), _learner_items(lcfg)
    state = ("master_params", "adam_moments", "gradients", "ref_params", "frozen_base")
    assert l["frozen_base"] == f["master_params"] // 2  # the float32 master's shard, held in bfloat16 instead
    assert l["ref_params"] == 0 and l["gathered_grads"] == 0
    assert 0 < l["adam_moments"] < f["adam_moments"] / 50
    assert sum(l[k] for k in state) < 0.15 * sum(f.get(k, 0) for k in state)
    # One version of adapters (float32) against the whole model in rollout.dtype: <= 2% at rank 16.
    arch = PRESETS[full.model.preset]
    adapters = sum(math.prod(s) for s, _ in lora_table(arch, 16, lora.PROJECTIONS))
    whole = sum(math.prod(s) for s, _ in param_table(arch))
    assert 4 * adapters <= 0.02 * 2 * whole
