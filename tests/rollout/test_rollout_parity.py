"""The engine against independent references: transformers greedy decoding and the training forward."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from laminar_jax.model import from_pretrained, token_logprobs
from laminar_jax.rollout import RolloutSection, SamplingParams, generate, make_engine
from tests.model.hf_fixtures import save_hf_model

# Different lengths in one batch, crossing page (8) and bucket (16) boundaries.
PROMPTS = [[1, 5, 9], [1, 17, 33, 4, 60, 61, 62, 63, 64, 70, 71, 72, 80, 90, 91, 92, 93, 11, 12], [1, 44],
           [1, 3, 5, 7, 9, 11, 13, 15, 17]]
MAX_NEW = 12
SECTION = RolloutSection(num_slots=3, page_size=8, num_pages=24, max_prompt_len=32, max_total_len=48,
                         max_new_tokens=MAX_NEW, prefill_buckets=(16, 32))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, str(path))
    model = from_pretrained(str(path))
    return request.param, hf, model, make_engine(model, SECTION)


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          pad_token_id=0, eos_token_id=2)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers(family_model):
    family, hf, _, engine_params = family_model
    # 4 prompts on 3 slots: the last one is admitted when a slot frees (continuous batching).
    outs = generate(engine_params, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                                           stop_token_ids=(2,)))
    for prompt, out in zip(PROMPTS, outs):
        ref = _hf_greedy(hf, prompt, MAX_NEW)
        assert out.tokens.tolist() == ref, (family, prompt)
        assert out.finish_reason == ("eos" if ref[-1] == 2 else "length")


def _learner_logprobs(model, prompts, responses, temps):
    """token_logprobs of each response under one padded training forward (right padding, segment 0)."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    t = max(map(len, rows))
    toks = np.zeros((len(rows), t), np.int32)
    seg = np.zeros((len(rows), t), np.int32)
    for i, row in enumerate(rows):
        toks[i, :len(row)], seg[i, :len(row)] = row, 1
    logits = model.forward(jnp.asarray(toks), segment_ids=jnp.asarray(seg)).logits
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        lg = logits[i, len(p) - 1:len(p) + len(r) - 1]
        out.append(np.asarray(token_logprobs(lg, jnp.asarray(r), temps[i])))
    return out


def test_behaviour_logprobs_match_learner_forward(family_model):
    """Engine log-probs == token_logprobs(model.forward(prompt+response), T) within 1e-4 (fp32).

    Mixed temperatures in one batch (per-slot sampling params).
    """
    _, _, model, engine_params = family_model
    temps = [1.0, 0.7, 1.3, 1.0]
    outs = generate(engine_params, PROMPTS, [SamplingParams(temperature=t, max_new_tokens=MAX_NEW) for t in temps])
    ref = _learner_logprobs(model, PROMPTS, [o.tokens.tolist() for o in outs], temps)
    for out, r in zip(outs, ref):
        assert len(out.logprobs) == len(out.tokens) > 0
        np.testing.assert_allclose(out.logprobs, r, atol=1e-4)
