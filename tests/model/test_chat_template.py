"""Chat templates: token ids equal transformers' apply_chat_template on Llama-3-, Qwen2.5- and Qwen3-style
templates; missing templates and overrides; the sandbox; the data plane renders chat prompts with them."""

import json

import pytest

from laminar_jax.model import chat_template as ct
from laminar_jax.model.tokenizer import BuiltinTokenizer, HFTokenizer
from tests.model.chat_fixtures import FAMILIES, QWEN25_TEMPLATE, write_tokenizer_dir

transformers = pytest.importorskip("transformers")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
CALC_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "a * b", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 12 times 7?"}],
    "system_user": [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is 12 times 7?"}],
    "multi_turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! <think>not this</think> How can I help?"},
                   {"role": "user", "content": "Weather in Paris, é ü 中文?"}],
    "thinking_history": [{"role": "user", "content": "12*7?"},
                         {"role": "assistant", "content": "84", "reasoning_content": "12*7 = 84."},
                         {"role": "user", "content": "and 12*8?"}],
    "tool_call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"},
                  {"role": "user", "content": "And Tokyo?"}],
}
# Llama-3.1's template accepts one tool call per message and renders a trailing assistant turn
# like any other; the conversations above are all valid for all three.
CASES = [(fam, conv, tools, flags)
         for fam in FAMILIES
         for conv in CONVERSATIONS
         for tools in (None, [WEATHER_TOOL, CALC_TOOL])
         for flags in ({}, {"enable_thinking": False}, {"date_string": "01 Jan 2026"})
         if not (fam != "qwen3" and flags.get("enable_thinking") is False)]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {fam: write_tokenizer_dir(str(root / fam), fam) for fam in FAMILIES}


@pytest.fixture(scope="module")
def hf_pairs(tok_dirs):
    return {fam: (HFTokenizer(d), transformers.AutoTokenizer.from_pretrained(d)) for fam, d in tok_dirs.items()}


def _hf_ids(hf, conv, tools, flags, add_generation_prompt=True):
    return list(hf.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                       tokenize=True, return_dict=False, **flags))


@pytest.mark.parametrize("fam,conv,tools,flags", CASES,
                         ids=[f"{f}-{c}-{'tools' if t else 'notools'}-{'_'.join(fl) or 'plain'}"
                              for f, c, t, fl in CASES])
def test_token_ids_equal_transformers(hf_pairs, fam, conv, tools, flags):
    ours, hf = hf_pairs[fam]
    messages = CONVERSATIONS[conv]
    text = ours.apply_chat_template(messages, tools=tools, **flags)
    assert ours.encode(text) == _hf_ids(hf, messages, tools, flags)
    assert text == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **flags)


def test_template_flags_change_the_prompt(hf_pairs):
    ours, _ = hf_pairs["qwen3"]
    msgs = CONVERSATIONS["single_user"]
    on, off = ours.apply_chat_template(msgs), ours.apply_chat_template(msgs, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    no_cue = ours.apply_chat_template(msgs, add_generation_prompt=False)
    assert not no_cue.endswith("<|im_start|>assistant\n") and on.endswith("<|im_start|>assistant\n")
    llama, hf = hf_pairs["llama3"]
    with_tools = llama.apply_chat_template(msgs, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in with_tools and with_tools.startswith("<|begin_of_text|>")


def test_raise_exception_in_a_template_is_an_error(hf_pairs):
    ours, _ = hf_pairs["llama3"]
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]}]
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        ours.apply_chat_template(two_calls)


def test_chat_template_jinja_file_is_used_and_wins(tmp_path):
    d = write_tokenizer_dir(str(tmp_path / "q"), "qwen2.5", as_jinja_file=True)
    ours, hf = HFTokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    msgs = CONVERSATIONS["system_user"]
    assert ours.encode(ours.apply_chat_template(msgs)) == _hf_ids(hf, msgs, None, {})


def test_no_template_names_the_file_and_an_override_renders(tmp_path):
    d = write_tokenizer_dir(str(tmp_path / "bare"), "qwen2.5", with_template=False)
    tok = HFTokenizer(d)
    with pytest.raises(ct.MissingChatTemplateError, match=r"bare/tokenizer_config.json: no 'chat_template'"):
        tok.apply_chat_template(CONVERSATIONS["single_user"])
    out = tok.apply_chat_template(CONVERSATIONS["single_user"], chat_template=QWEN25_TEMPLATE)
    assert out.startswith("<|im_start|>system\nYou are Qwen")


def test_named_templates_pick_tool_use_with_tools(tmp_path):
    d = write_tokenizer_dir(str(tmp_path / "named"), "qwen2.5", with_template=False)
    cfg_file = tmp_path / "named" / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}"}]
    cfg_file.write_text(json.dumps(cfg))
    tok = HFTokenizer(d)
    assert tok.apply_chat_template(CONVERSATIONS["single_user"]) == "DWhat is 12 times 7?"
    assert tok.apply_chat_template(CONVERSATIONS["single_user"], tools=[WEATHER_TOOL]) == "T1"


def test_the_sandbox_refuses_python_internals():
    import jinja2.exceptions
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert isinstance(ct.compile_template("{{ 1 }}").environment, ImmutableSandboxedEnvironment)

    with pytest.raises(jinja2.exceptions.SecurityError):
        ct.render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                  [{"role": "user", "content": "x"}], special_tokens={})
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable: templates cannot mutate their inputs
        ct.render("{{ messages.append(1) }}", [{"role": "user", "content": "x"}], special_tokens={})


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"
HUGE = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"


@pytest.mark.parametrize("template,what", [(LOOP, "ran longer than"), (HUGE, "output of")])
def test_a_runaway_template_is_an_error_naming_its_file(tmp_path, template, what):
    import time

    d = write_tokenizer_dir(str(tmp_path / "tok"), "qwen2.5", with_template=False)
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)
    tok = HFTokenizer(d)
    t0 = time.monotonic()
    with pytest.raises(ct.ChatTemplateBudgetError, match=what) as e:
        tok.apply_chat_template(CONVERSATIONS["single_user"])
    assert str(tmp_path / "tok" / "chat_template.jinja") in str(e.value)
    assert time.monotonic() - t0 < 60  # stopped, not run out: the loop alone is 10^10 iterations
    override = tmp_path / "override.jinja"  # data.chat_template as a file: that file is named
    override.write_text(template)
    with pytest.raises(ct.ChatTemplateBudgetError, match=str(override)):
        tok.apply_chat_template(CONVERSATIONS["single_user"], chat_template=ct.resolve_override(str(override)))


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**9 }}", "{{ [0] * 10**9 }}", "{{ 9 ** 1000000000 }}", "{{ 'x' | center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}", "{{ '%999999999d' % 1 }}", "{{ '{:>999999999}'.format(1) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
])
def test_one_huge_value_is_refused_before_it_is_built(template):
    with pytest.raises(ct.ChatTemplateBudgetError, match="the chat template .given as text."):
        ct.render(template, [{"role": "user", "content": "x"}], special_tokens={},
                  budget=ct.RenderBudget(seconds=10.0, chars=1_000_000))


def test_the_budget_leaves_ordinary_templates_alone():
    out = ct.render("{% for m in messages %}{{ m.content * 3 }}{{ '%5d' % 42 }}{{ 'a' ~ 'b' }}{% endfor %}",
                    [{"role": "user", "content": "xy"}], special_tokens={}, budget=ct.RenderBudget(1.0, 100))
    assert out == "xyxyxy   42ab"
    with pytest.raises(ct.ChatTemplateBudgetError, match="output of 101"):
        ct.render("{{ 'x' * 50 }}{{ 'y' * 51 }}", [{"role": "user", "content": "x"}], special_tokens={},
                  budget=ct.RenderBudget(1.0, 100))


def test_builtin_template_keeps_the_demo_format():
    tok = BuiltinTokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "ab*4="}]) == "ab*4="
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q?"}]
    assert tok.apply_chat_template(two) == "system: Be brief.\nuser: q?\nassistant: "
    assert tok.apply_chat_template(two, chat_template="{{ messages[-1].content }}!") == "q?!"


def _row(prompt, **extra):
    return {"data_source": "t", "prompt": prompt, "reward_model": {"ground_truth": "84"}, **extra}


def test_data_plane_renders_chat_prompts_like_transformers(tmp_path, hf_pairs, tok_dirs):
    from laminar_jax.data.config import DataSection
    from laminar_jax.data.source import build_prompt_source

    rows = [_row(CONVERSATIONS["system_user"]), _row(CONVERSATIONS["multi_turn"], tools=[WEATHER_TOOL]),
            _row("plain text prompt")]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for fam, flags in (("llama3", {}), ("qwen3", {"enable_thinking": False})):
        ours, hf = hf_pairs[fam]
        sec = DataSection(source="file", path=str(path), shuffle=False, num_epochs=1, max_prompt_tokens=4096,
                          chat_template_kwargs=flags)
        got = {p.index: p.prompt_ids for p in build_prompt_source(sec, ours)}
        assert got[0] == _hf_ids(hf, rows[0]["prompt"], None, flags)
        assert got[1] == _hf_ids(hf, rows[1]["prompt"], [WEATHER_TOOL], flags)
        bos = [ours.bos_id] if ours.bos_id is not None else []
        assert got[2] == bos + ours.encode("plain text prompt")
        if fam == "llama3":  # the template writes BOS; add_bos never doubles it
            assert got[0][0] == ours.bos_id and got[0][1] != ours.bos_id


def test_data_plane_chat_template_override_and_missing_template(tmp_path):
    from laminar_jax.data.config import DataSection
    from laminar_jax.data.source import build_prompt_source

    d = write_tokenizer_dir(str(tmp_path / "bare"), "qwen2.5", with_template=False)
    tok = HFTokenizer(d)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_row([{"role": "user", "content": "What is 12 times 7?"}])) + "\n")
    sec = DataSection(source="file", path=str(path), shuffle=False, num_epochs=1)
    with pytest.raises(ct.MissingChatTemplateError, match="bare/tokenizer_config.json"):
        next(iter(build_prompt_source(sec, tok)))
    tfile = tmp_path / "t.jinja"
    tfile.write_text("Q: {{ messages[0].content }}\nA:")
    for override in (str(tfile), "Q: {{ messages[0].content }}\nA:"):
        p = next(iter(build_prompt_source(DataSection(source="file", path=str(path), shuffle=False, num_epochs=1,
                                                      chat_template=override), tok)))
        assert p.prompt_text == "Q: What is 12 times 7?\nA:"
    with pytest.raises(FileNotFoundError, match="data.chat_template='nope.jinja'"):
        build_prompt_source(DataSection(source="file", path=str(path), chat_template="nope.jinja"), tok)


def test_a_row_the_template_rejects_is_a_bad_row_naming_it(tmp_path, tok_dirs):
    from laminar_jax.data.config import DataSection
    from laminar_jax.data.records import BadRowError
    from laminar_jax.data.source import build_prompt_source

    tok = HFTokenizer(tok_dirs["llama3"])
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]}]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_row(two_calls)) + "\n")
    with pytest.raises(BadRowError, match=r"p.jsonl.*chat template: This model only supports single tool-calls"):
        next(iter(build_prompt_source(DataSection(source="file", path=str(path), num_epochs=1), tok)))
