"""learner.lora in a whole run: the demo trains adapters through the local runtime (versions reach the
servers merged), stops, and a second run resumes from its checkpoint (adapters, their optimizer state,
the ledger) without losing or repeating a prompt."""

import json

import pytest
from safetensors.numpy import load_file

from laminar_jax.config import finalize, repo_config
from laminar_jax.model import lora
from laminar_jax.model.presets import PRESETS


@pytest.mark.slow
def test_lora_demo_runs_then_resumes_exactly_once(tmp_path):
    from laminar_jax.runtime.local import run_local

    def config(steps):
        c = repo_config("demo", "short")
        c.learner.lora.rank = 4
        c.learner.compile_ahead = "none"
        c.runtime.total_steps = steps
        c.runtime.run_dir = str(tmp_path / "run")
        return finalize(c)

    first = run_local(config(2))
    assert first["steps"] == 2 and first["lost_prompts"] == 0 and first["duplicated_prompts"] == 0
    second = run_local(config(4))
    assert second["steps"] == 4 and second["steps_this_run"] == 2
    assert second["restore"]["step"] == 2
    assert second["lost_prompts"] == 0 and second["duplicated_prompts"] == 0
    assert second["consumed_prompts"] == 4 * config(4).runtime.prompts_per_step

    # The run's adapters in PEFT's format, from its newest checkpoint; the merged model from its store.
    from laminar_jax.weights.export import export_peft, export_pretrained

    got = export_peft(str(tmp_path / "run"), str(tmp_path / "peft"))
    assert got["version"] == 4
    assert json.load(open(tmp_path / "peft" / "adapter_config.json"))["r"] == 4
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    # Every projection of every layer of the demo's model has an A and a B.
    assert len(tensors) == 2 * len(lora.PROJECTIONS) * PRESETS[config(4).model.preset].num_layers
    assert any(abs(v).max() > 0 for k, v in tensors.items() if "lora_B" in k)  # B trained away from zero
    export_pretrained(str(tmp_path / "run"), str(tmp_path / "merged"))
    assert (tmp_path / "merged" / "config.json").exists()
