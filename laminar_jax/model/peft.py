"""Adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained`` loads onto the HF base model.

Names: the contract's '<module>.lora_a' [(L,) r, in] / '.lora_b' [(L,) out, r] (model/lora.py) are,
per layer l, PEFT's 'base_model.model.model.layers.{l}.<...>.lora_A.weight' [r, in] and
'...lora_B.weight' [out, r]: the same layout, so writing is slicing the layer axis and renaming.
The scale is PEFT's lora_alpha / r (use_rslora false), as the contract's.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import numpy as np

from laminar_jax.model import lora
from laminar_jax.model.hf import hf_name

PEFT_PREFIX = "base_model.model."
_PEFT_SUFFIX = {lora.SUFFIX_A: "lora_A.weight", lora.SUFFIX_B: "lora_B.weight"}


def peft_names(adapter: str, layers: Optional[int] = None) -> list[str]:
    """PEFT's tensor names of one adapter tensor: one per layer when stacked (``layers`` of them)."""
    param = lora.base_name(adapter)
    path = tuple(param.split("."))
    suffix = _PEFT_SUFFIX[adapter.rpartition(".")[2]]
    stems = [hf_name(path, i) for i in range(layers)] if lora.is_stacked(param) else [hf_name(path)]
    return [PEFT_PREFIX + s[: -len("weight")] + suffix for s in stems]


def peft_tensors(adapters: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The contract's flat adapters as PEFT's per-layer tensors (float32)."""
    out = {}
    for name in sorted(adapters):
        arr = np.asarray(adapters[name], np.float32)
        stacked = lora.is_stacked(lora.base_name(name))
        for i, key in enumerate(peft_names(name, arr.shape[0] if stacked else None)):
            out[key] = np.ascontiguousarray(arr[i] if stacked else arr)
    return out


def adapter_config(section: lora.LoRASection, base_model: Optional[str] = None) -> dict:
    """PEFT's LoraConfig fields for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": section.rank, "lora_alpha": section.alpha,
            "lora_dropout": section.dropout, "target_modules": sorted(section.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base_model}


def write_peft_adapter(adapters: Mapping[str, Any], section: lora.LoRASection, out_dir: str,
                       base_model: Optional[str] = None) -> list[str]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir``; their paths."""
    from safetensors.numpy import save_file

    if not section.enabled:
        raise ValueError("write_peft_adapter: learner.lora.rank is 0 (no adapters to write)")
    os.makedirs(out_dir, exist_ok=True)
    cfg_path = os.path.join(out_dir, "adapter_config.json")
    with open(cfg_path, "w") as f:
        json.dump(adapter_config(section, base_model), f, indent=2)
    weights = os.path.join(out_dir, "adapter_model.safetensors")
    save_file(peft_tensors(adapters), weights, metadata={"format": "pt"})
    return [cfg_path, weights]
