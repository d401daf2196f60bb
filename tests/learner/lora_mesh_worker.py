"""Child process of test_lora_mesh.py: a LoRA learner on a mesh of host devices (argv: data,fsdp,tensor
and optionally learner.lora.dropout), a few steps on a fixed batch; prints JSON: adapters after the steps, whether the base stayed put, and
the adapters' and base's shardings."""

import dataclasses
import json
import sys

import jax
import numpy as np


def main(mesh: str, dropout: float = 0.0) -> None:
    from laminar_jax.learner import Learner
    from laminar_jax.learner.config import MeshSection
    from laminar_jax.learner.publish import flatten_params
    from tests.learner.test_lora_learner import SECTION, _model, _trajectories

    data, fsdp, tensor = (int(x) for x in mesh.split(","))
    # Dropout masks belong to row positions: with them on, rows keep the single device's order
    # (balance_tokens would reorder them across the data-parallel ranks).
    section = dataclasses.replace(SECTION, lora=dataclasses.replace(SECTION.lora, dropout=dropout),
                                  balance_tokens=SECTION.balance_tokens and not dropout)
    learner = Learner(section, _model(), MeshSection(data=data, fsdp=fsdp, tensor=tensor), publish_dtype="bfloat16")
    base0 = {k: np.asarray(v) for k, v in flatten_params(learner.state.frozen["actor"]).items()}
    for _ in range(2):
        learner.step(_trajectories())
    base1 = {k: np.asarray(v) for k, v in flatten_params(learner.state.frozen["actor"]).items()}
    specs = {k: str(v.sharding.spec) for k, v in flatten_params(learner.state.params["actor"]).items()}
    specs.update({k: str(v.sharding.spec) for k, v in flatten_params(learner.state.frozen["actor"]).items()})
    out = {"adapters": {k: v.astype(float).tolist() for k, v in learner.adapter_params().items()},
           "base_unchanged": all(np.array_equal(base0[k], base1[k]) for k in base0), "specs": specs,
           "devices": len(jax.devices())}
    learner.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], *(float(x) for x in sys.argv[2:]))
