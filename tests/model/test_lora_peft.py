"""LoRA export: PEFT's adapter format loads with `peft` onto the HF base with logits equal to our adapted
model's, and the merged HF checkpoint loads in transformers with the same logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("peft")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from peft import PeftModel  # noqa: E402

from laminar_jax.learner.publish import flatten_params, load_model_params  # noqa: E402
from laminar_jax.model import from_pretrained, lora, save_pretrained  # noqa: E402
from laminar_jax.model.peft import peft_names, write_peft_adapter  # noqa: E402
from tests.model.hf_fixtures import save_hf_model  # noqa: E402

TOKENS = np.array([[1, 5, 9, 14, 3, 33, 70, 2], [1, 40, 41, 42, 8, 8, 90, 11]], np.int32)


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def test_peft_names():
    assert peft_names("layers.self_attn.q_proj.lora_a", 2) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    assert peft_names("layers.mlp.down_proj.lora_b", 1) == [
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert peft_names("lm_head.lora_b") == ["base_model.model.lm_head.lora_B.weight"]


def test_peft_adapter_loads_onto_hf_base_with_our_logits(tmp_path):
    base_dir, adapter_dir, merged_dir = (str(tmp_path / d) for d in ("base", "adapter", "merged"))
    save_hf_model("qwen2", base_dir)
    section = lora.LoRASection(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    ours = lora.attach(from_pretrained(base_dir), section)
    graphdef, adapters, base = nnx.split(ours, nnx.LoRAParam, nnx.Param)
    key = jax.random.key(3)  # trained-looking adapters: B no longer zero
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(key, x.shape), adapters)
    ours = nnx.merge(graphdef, adapters, base)
    want = np.asarray(ours(jnp.asarray(TOKENS)))
    flat = {k: np.asarray(v) for k, v in flatten_params(adapters).items()}
    write_peft_adapter(flat, section, adapter_dir, base_model=base_dir)
    cfg = json.load(open(f"{adapter_dir}/adapter_config.json"))
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 8.0, "LORA")

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    plain = _hf_logits(hf_base)
    peft_model = PeftModel.from_pretrained(hf_base, adapter_dir).eval()
    got = _hf_logits(peft_model)
    assert np.abs(want - plain).max() > 1e-2  # the adapters change the model (the check can fail)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    # The merged checkpoint: a plain model holding merge()d weights, loaded by transformers.
    merged = from_pretrained(base_dir)
    load_model_params(merged, lora.merge_params({k: np.asarray(v) for k, v in flatten_params(base).items()},
                                                flat, section.scale))
    save_pretrained(merged, merged_dir)
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logits(hf_merged), want, rtol=1e-4, atol=1e-4)


def test_learner_export_writes_merged_and_peft_dirs(tmp_path):
    """A trained LoRA learner's export: PEFT on the base == the merged directory == our published policy."""
    from laminar_jax.learner import Learner, LearnerSection
    from laminar_jax.learner.lora import export
    from laminar_jax.model.config import ModelSection
    from laminar_jax.types import Trajectory

    base_dir = str(tmp_path / "base")
    save_hf_model("qwen2", base_dir)
    section = LearnerSection(lr=3e-2, adv_estimator="grpo", seq_len_buckets=(16,), pack_length=0,
                             lora=lora.LoRASection(rank=2, alpha=4.0))
    learner = Learner(section, from_pretrained(base_dir), publish_dtype="float32")
    rng = np.random.default_rng(0)
    trajs = [Trajectory(f"{i}", "p", i, np.array([1, 4], np.int32), rng.integers(3, 90, 6).astype(np.int32),
                        np.full(6, -4.0, np.float32), 0, reward=float(i)) for i in range(4)]
    learner.step(trajs)
    paths = export(learner, ModelSection(path=base_dir), str(tmp_path / "out"))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    plain = _hf_logits(hf_base)
    via_peft = _hf_logits(PeftModel.from_pretrained(hf_base, paths["adapter"]).eval())
    merged = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(paths["merged"],
                                                                          torch_dtype=torch.float32).eval())
    assert np.abs(via_peft - plain).max() > 1e-4
    np.testing.assert_allclose(via_peft, merged, rtol=1e-4, atol=1e-4)
    ours = from_pretrained(base_dir)
    load_model_params(ours, learner.policy_params())
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(TOKENS))), merged, rtol=1e-4, atol=1e-4)
    learner.close()
