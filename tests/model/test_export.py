"""export_pretrained writes a self-contained HF directory: transformers loads the demo policy and its
tokenizer with nothing built by hand, with equal logits and equal prompt ids."""

import json
import os

import numpy as np
import pytest

from laminar_jax.config import finalize, repo_config, save_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _demo_run_dir(tmp_path, **overrides):
    """A run directory as a run leaves it: config.json and one perturbed weight version in the store."""
    from flax import nnx

    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model import build_model
    from laminar_jax.relay import WeightStore

    cd = repo_config("demo", "short")
    for key, value in overrides.items():
        section, field = key.split(".")
        setattr(getattr(cd, section), field, value)
    cd.runtime.run_dir = str(tmp_path / "run")
    cfg = finalize(cd)
    run_dir = cfg.runtime.run_dir
    save_config(cfg, run_dir)
    model = build_model(cfg.model)
    rng = np.random.default_rng(0)
    flat = {k: np.asarray(v) + 0.05 * rng.standard_normal(np.shape(v)).astype(np.float32)
            for k, v in flatten_params(nnx.state(model, nnx.Param)).items()}
    WeightStore(os.path.join(run_dir, "weights"), keep_last=cfg.relay.keep_last).write(3, flat)
    return cfg, run_dir, flat


def test_demo_export_loads_in_transformers_with_equal_logits_and_ids(tmp_path):
    from laminar_jax.data.source import build_prompt_source
    from laminar_jax.model.tokenizer import BuiltinTokenizer
    from laminar_jax.weights.export import export_pretrained

    cfg, run_dir, flat = _demo_run_dir(tmp_path)
    out = str(tmp_path / "hf")
    model = export_pretrained(run_dir, out)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    gen = json.loads(open(os.path.join(out, "generation_config.json")).read())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours = BuiltinTokenizer()
    # The demo's own prompts: the data plane's prompt_ids equal transformers' chat-template ids.
    prompts = [p for _, p in zip(range(5), build_prompt_source(cfg.data, ours))]
    for p in prompts:
        msgs = [{"role": "user", "content": p.prompt_text}]
        hf_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(hf_ids) == p.prompt_ids
        assert hf_tok(p.prompt_text)["input_ids"] == p.prompt_ids  # BOS handling on plain text too
    text = "ab*3=ab,ab,ab,\n ~"
    assert hf_tok(text)["input_ids"] == [ours.bos_id] + ours.encode(text)
    assert hf_tok.decode(hf_tok(text)["input_ids"], skip_special_tokens=True) == text
    assert hf_tok.eos_token_id == ours.eos_id and hf_tok.pad_token_id == ours.pad_id

    n = min(len(p.prompt_ids) for p in prompts[:2])
    ids = np.asarray([p.prompt_ids[:n] for p in prompts[:2]], np.int32)
    ours_logits = np.asarray(model(ids))
    with torch.no_grad():
        hf_logits = hf_model(torch.as_tensor(ids).long()).logits.numpy()
    np.testing.assert_allclose(ours_logits, hf_logits, rtol=2e-4, atol=2e-4)
    # The exported weights are the stored version's, not the freshly initialised ones.
    from laminar_jax.model import build_model

    fresh = np.asarray(build_model(cfg.model)(ids))
    assert np.abs(fresh - hf_logits).max() > 1e-2


def test_tokenizer_json_file_spec_is_copied_with_its_companions(tmp_path):
    from laminar_jax.model import build_model
    from laminar_jax.model.export import write_hf_dir
    from tests.model.chat_fixtures import write_tokenizer_dir

    tok_dir = write_tokenizer_dir(str(tmp_path / "tok"), "qwen3")
    cd = repo_config("demo", "short")
    cd.model.tokenizer = os.path.join(tok_dir, "tokenizer.json")
    cfg = finalize(cd)
    out = str(tmp_path / "hf")
    write_hf_dir(build_model(cfg.model), cfg.model, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(tok_dir, name)).read()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == "<|im_end|>" and "enable_thinking" in hf_tok.chat_template
    gen = json.loads(open(os.path.join(out, "generation_config.json")).read())
    assert gen["eos_token_id"] == 2  # the tiny preset's eos id, as config.json says


def test_missing_tokenizer_is_an_error_naming_the_keys(tmp_path):
    from laminar_jax.model import build_model
    from laminar_jax.model.export import write_hf_dir

    cd = repo_config("demo", "short")
    cd.model.tokenizer = str(tmp_path)  # a directory without tokenizer.json
    cfg = finalize(cd)
    with pytest.raises(FileNotFoundError, match=r"model.tokenizer=.*no tokenizer.json to export"):
        write_hf_dir(build_model(cfg.model), cfg.model, str(tmp_path / "hf"))
