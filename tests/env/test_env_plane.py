"""Tool-call parsing, the built-in environments, the registry and the EnvPool's failure handling."""

import threading
import time

import pytest

from laminar_jax.env import (
    EnvPool, Environment, MalformedStepError, StepResult, ToolCall, ToolCallError, check_step, make_env,
    parse_tool_calls, register_env, registered, render_tool_message, select_env)
from laminar_jax.env.calculator import evaluate
from laminar_jax.env.tools import PLAIN_TOOL_FORMAT, has_open_call
from laminar_jax.model.tokenizer import BuiltinTokenizer


def test_hermes_tool_calls_parse():
    text = ('think <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call> and '
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("no call here") == []
    assert has_open_call('x <tool_call>{"name": ') and not has_open_call(text)
    with pytest.raises(ToolCallError, match="not JSON"):
        parse_tool_calls("<tool_call>{name: calculator}</tool_call>")
    with pytest.raises(ToolCallError, match="'arguments' must be an object"):
        parse_tool_calls('<tool_call>{"name": "c", "arguments": [1]}</tool_call>')


def test_tool_message_through_the_template_or_the_plain_format():
    assert render_tool_message("42", BuiltinTokenizer()) == "tool: 42\nassistant: "
    assert render_tool_message("42") == PLAIN_TOOL_FORMAT.format(content="42")

    class FakeNoToolRole:
        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "tool" for m in messages):
                raise ValueError("unknown role")
            return "".join(m["content"] for m in messages)

    assert render_tool_message("7", FakeNoToolRole()) == PLAIN_TOOL_FORMAT.format(content="7")
    # A runaway template is an error, not a template without tool support.
    from laminar_jax.model.chat_template import ChatTemplateBudgetError

    with pytest.raises(ChatTemplateBudgetError, match="output of"):
        render_tool_message("7", BuiltinTokenizer(),
                            chat_template="{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}")


def test_calculator_episode():
    env = make_env("calculator", max_turns=3)
    env.reset({"ground_truth": 87})
    assert evaluate("12 * 7 + 3") == 87
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7 + 3"}}</tool_call>'
    assert env.step(call) == ("87", 0.0, False)
    assert env.step("So the answer is 87") == (None, 1.0, True)
    env.reset({"ground_truth": 5})
    assert env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>'
                    ).observation.startswith("error:")
    assert env.step("it is 4") == (None, 0.0, True)


def test_latency_env_is_repeatable_and_ends_after_its_turns():
    env = make_env("latency", turns=2, median_s=0.01, sigma=0.1)
    env.reset({"uid": "p1"})
    t0 = time.monotonic()
    assert env.step("a") == (" ok ", 0.0, False)
    assert env.step("") == (None, 0.5, True)
    assert time.monotonic() - t0 < 1.0


def test_latency_env_defaults_are_the_simulators_agentic_preset():
    # One workload definition read from two planes that do not import each other.
    from laminar_jax.env.latency import MEDIAN_PRESET_S, SIGMA_PRESET
    from laminar_jax.sim.workload import PRESETS

    agentic = PRESETS["agentic"]
    assert (MEDIAN_PRESET_S, SIGMA_PRESET) == (agentic.env_latency_median_s, agentic.env_latency_sigma)


def test_selection_by_extra_info_verl_layout_and_data_source():
    assert select_env({"extra_info": {"env": "python", "env_kwargs": {"cpu_s": 1}}}) == ("python", {"cpu_s": 1})
    verl = {"extra_info": {"interaction_kwargs": {"name": "calculator", "max_turns": 2},
                           "tools_kwargs": {"calculator": {"create_kwargs": {}}}}}
    assert select_env(verl) == ("calculator", {"max_turns": 2, "tools_kwargs": {"calculator": {"create_kwargs": {}}}})
    assert make_env(*select_env(verl)[:1], **select_env(verl)[1]).max_turns == 2  # tools_kwargs dropped
    assert select_env({"data_source": "gsm"}, by_data_source={"gsm": "calculator"}) == ("calculator", {})
    assert select_env({"data_source": "x"}, default="latency") == ("latency", {})
    with pytest.raises(ValueError, match="data_source='x': no environment named"):
        select_env({"data_source": "x"})
    with pytest.raises(ValueError, match="environment 'nope' is not registered"):
        make_env("nope")
    assert {"calculator", "python", "latency"} <= set(registered())


def test_malformed_steps_are_named():
    assert check_step(("obs", 1, False), "e") == StepResult("obs", 1.0, False)
    assert check_step((None, 0.0, False), "e").done  # no observation: the episode ends
    for bad in ["text", ("o", float("nan"), False), ("o", 1.0, "yes"), (3, 1.0, False)]:
        with pytest.raises(MalformedStepError, match="env 'e'"):
            check_step(bad, "e")


class FakeHangingEnv(Environment):
    def __init__(self, release: threading.Event):
        self.release = release

    def step(self, action_text):
        self.release.wait(10)
        return StepResult(None, 1.0, True)


def test_pool_times_out_a_hanging_call_and_goes_on():
    release = threading.Event()
    pool = EnvPool(workers=1, timeout_s=0.3)
    try:
        hung = pool.submit(FakeHangingEnv(release).step, "x")
        ok = pool.submit(lambda: 7)  # queued behind the hung call: runs once its deadline frees the worker
        r = hung.result(timeout=5)
        assert not r.ok and r.error.startswith("timeout") and r.value is None
        assert ok.result(timeout=5) == (7, True, None, pytest.approx(ok.result().latency_s))
        boom = pool.submit(lambda: 1 / 0).result(timeout=5)
        assert not boom.ok and boom.error.startswith("ZeroDivisionError")
        s = pool.stats()
        assert (s.calls, s.failures, s.timeouts, s.in_flight) == (3, 2, 1, 0)
        assert s.latency_p99_s > 0.25  # the timed-out call counts at its deadline
    finally:
        release.set()
        pool.close()


def test_registered_custom_env():
    class FakeEcho(Environment):
        def step(self, action_text):
            return StepResult(None, float(len(action_text)), True)

    register_env("fake-echo", FakeEcho)
    assert make_env("fake-echo").step("abc") == (None, 3.0, True)
