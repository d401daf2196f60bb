"""Reward registry and built-in scorers: math_verify, reasoning-gym, exact match."""

import os
import threading

import pytest

from laminar_jax.data import DataSection, RewardRegistry, build_prompt_source, default_registry
from laminar_jax.data.reasoning_gym_task import extract_answer
from laminar_jax.data.rewards import exact_match_reward, load_registry, math_reward
from laminar_jax.model.tokenizer import BuiltinTokenizer


@pytest.mark.parametrize(
    "source", ["math", "openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "BytedTsinghua-SIA/DAPO-Math-17k", "new"]
)
def test_math_sources_use_math_verify(source):
    fn = default_registry().get_reward_fn(source)
    assert fn is math_reward
    assert fn("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", {}) == 1.0
    assert fn("We get \\boxed{3/6}", "\\frac{1}{2}", {}) == 1.0
    assert fn("So the answer is $\\boxed{\\frac{1}{3}}$.", "0.5", {}) == 0.0
    assert fn("I don't know", "0.5", {}) == 0.0


def test_math_reward_works_off_the_main_thread():
    # math_verify's signal timeouts fail outside the main thread; math_reward must avoid them there.
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{72}", "72", {})))
    t.start()
    t.join(60)
    assert out == [1.0]


def test_exact_match_and_registry_lookup(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
    assert exact_match_reward("  Paris \n", "Paris") == 1.0 and exact_match_reward("paris", "Paris") == 0.0
    reg = RewardRegistry()
    reg.register_reward("a", lambda r, g, e: 1.0)
    reg.register_reward("rg/", lambda r, g, e: 2.0, prefix=True)
    reg.register_reward("rg/long/", lambda r, g, e: 3.0, prefix=True)
    assert reg.score("a", "", None, None) == 1.0
    assert reg.score("rg/x", "", None, None) == 2.0 and reg.score("rg/long/x", "", None, None) == 3.0
    with pytest.raises(KeyError, match="no reward function for data_source='b'"):
        reg.get_reward_fn("b")
    with pytest.raises(TypeError):
        reg.register_reward("c", 3)
    with pytest.raises(TypeError, match="not RewardRegistry"):
        load_registry("data_reward_probes:not_a_registry")
    assert default_registry() is not default_registry()  # no shared mutable state


def test_extract_answer():
    assert extract_answer("think <answer>1</answer> more <answer> 42 </answer>") == "42"
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("work\n\nfinal: 7\n") == "final: 7"
    assert extract_answer("   ") is None


@pytest.mark.parametrize("name", ["basic_arithmetic", "leg_counting"])
def test_reasoning_gym_scored_by_its_own_scorer(name):
    section = DataSection(source="reasoning_gym", reasoning_gym_dataset=name, dataset_size=20, seed=3, num_epochs=1,
                          max_prompt_tokens=2048)  # character tokens: leg_counting prompts run long
    prompts = list(build_prompt_source(section, BuiltinTokenizer()))
    assert len(prompts) == 20 and len({p.prompt_text for p in prompts}) > 10
    reg = default_registry()
    for p in prompts[:5]:
        assert p.data_source == f"reasoning_gym/{name}"
        assert "<answer>" in p.prompt_text
        fn = reg.get_reward_fn(p.data_source)
        assert fn(f"Let me think.\n<answer>{p.ground_truth}</answer>", p.ground_truth, p.extra_info) == 1.0
        assert fn(f"<answer>{int(p.ground_truth) + 1}</answer>", p.ground_truth, p.extra_info) < 1.0
        assert fn("", p.ground_truth, p.extra_info) == 0.0


def test_unknown_reasoning_gym_dataset_is_named():
    with pytest.raises(ValueError, match="no_such_task"):
        build_prompt_source(DataSection(source="reasoning_gym", reasoning_gym_dataset="no_such_task"), None)


def test_reasoning_gym_held_out_prompts_come_from_another_seed():
    from laminar_jax.data.source import build_val_prompts

    section = DataSection(source="reasoning_gym", reasoning_gym_dataset="basic_arithmetic", dataset_size=20, seed=3,
                          num_epochs=1, shuffle=False, val_size=8, max_prompt_tokens=2048)
    train = {p.prompt_text for p in build_prompt_source(section, BuiltinTokenizer())}
    val = build_val_prompts(section, BuiltinTokenizer())
    assert len(val) == 8 and all(p.data_source == "reasoning_gym/basic_arithmetic" for p in val)
    assert len({p.prompt_text for p in val} - train) >= 7  # a small problem space may repeat one by chance
    assert DataSection(source="file", path="x.jsonl", val_size=8).has_val() is False  # files name theirs


def test_warm_ups_run_once_and_report_their_errors_without_raising():
    reg, calls = RewardRegistry(), []
    reg.register_warm_up(lambda: calls.append(1))

    def broken():
        raise ImportError("no such scorer library")

    reg.register_warm_up(broken)
    errors = reg.warm_up()
    assert calls == [1] and len(errors) == 1 and "'broken'" in errors[0] and "no such scorer library" in errors[0]
    assert reg.warm_up() == [] and calls == [1]
    with pytest.raises(TypeError, match="warm-up must be callable"):
        reg.register_warm_up("not a function")


def test_math_reward_off_the_main_thread_prints_no_timeout_notice(monkeypatch, caplog):
    """Reward threads call math_verify without its signal timeout (the pool's deadline bounds the
    call): its "Timeout is disabled ..." warning is filtered out, other math_verify warnings are not."""
    import logging

    import math_verify.grader
    import math_verify.parser

    for mod in (math_verify.parser, math_verify.grader):  # the notice shows once per process: show it again
        monkeypatch.setattr(mod, "TIMEOUT_WARNING_SHOWN", False)
    caplog.set_level(logging.WARNING)
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("$\\boxed{2}$", "2")))
    t.start()
    t.join(30)
    assert out == [1.0]
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()], caplog.text
    logging.getLogger("math_verify.parser").warning("another warning")
    assert "another warning" in caplog.text
