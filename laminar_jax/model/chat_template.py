"""Chat templates: a model's own Jinja `chat_template`, rendered as transformers renders it.

Hugging Face models ship their prompt format as a Jinja template (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` file). Templates come from the Hub and are
untrusted code, so they run in jinja2's ImmutableSandboxedEnvironment with the same options and
helpers transformers gives them (``raise_exception``, a ``tojson`` that does not HTML-escape,
``strftime_now``, loop controls, trim_blocks / lstrip_blocks), and see only plain JSON data.
Rendering the same template with the same inputs gives the same text as
``transformers.AutoTokenizer.apply_chat_template(..., tokenize=False)``.
A render runs under a time and output budget (template_budget.py); a template past it raises
ChatTemplateBudgetError naming the template file.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Optional, Sequence, Union

from laminar_jax.model import template_budget as tb
from laminar_jax.model.template_budget import RenderBudget

# The names under which tokenizer_config.json gives special tokens; templates read e.g. bos_token.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


class MissingChatTemplateError(ValueError):
    """Chat-message prompts, but the tokenizer has no chat template; the message names the file."""


class ChatTemplateBudgetError(ValueError):
    """A template ran past its render budget (time, output, or one value's size); the message names the file."""


class TemplateText(str):
    """Template text that remembers where it came from (a file, or the setting that gave it inline)."""

    origin: str

    def __new__(cls, text: str, origin: str):
        self = super().__new__(cls, text)
        self.origin = origin
        return self


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes '<' and '>', which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment_class():
    """ImmutableSandboxedEnvironment whose `*`, `**`, `%`, `~` and calls check the render budget."""
    from jinja2.compiler import CodeGenerator, optimizeconst
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetCodeGenerator(CodeGenerator):
        @optimizeconst
        def visit_Concat(self, node, frame):  # `a ~ b`: jinja's str_join, with the size checked first
            self.write("environment.budget_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetSandboxedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetCodeGenerator
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            tb.check_binop(operator, left, right)
            return tb.check_result(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            tb.check_call(__obj, args, kwargs)
            return tb.check_result(super().call(__context, __obj, *args, **kwargs))

        @staticmethod
        def budget_join(parts):
            return tb.budget_join(parts)

    return BudgetSandboxedEnvironment


@functools.lru_cache(maxsize=32)
def compile_template(source: str):
    """A compiled, sandboxed, budgeted template (cached: one compile per distinct template text)."""
    import jinja2.ext

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: tb.guard_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def plain_data(value: Any, where: str) -> Any:
    """A deep copy made of JSON types only: the sandbox never sees objects with methods of their own."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: chat template input is not JSON data ({e})") from None


def check_messages(messages: Sequence[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"chat messages must be a non-empty list, got {messages!r:.200}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"chat message {i} must be a dict with a 'role' string, got {m!r:.200}")


def render(source: str, messages: Sequence[dict], *, special_tokens: dict[str, str], tools=None,
           add_generation_prompt: bool = True, where: Optional[str] = None,
           budget: RenderBudget = RenderBudget(), **template_kwargs) -> str:
    """Render `messages` through the template `source`, within `budget`.

    As transformers does: keys whose value is None are dropped from messages (templates test for
    presence, not for None), special tokens are visible by name, and template_kwargs (template flags
    such as Qwen3's ``enable_thinking``) override them. `where` names the template in errors (default:
    the source's origin when it is a TemplateText).
    """
    check_messages(messages)
    msgs = [{k: v for k, v in m.items() if v is not None} for m in plain_data(list(messages), "messages")]
    ctx = {**special_tokens, **plain_data(template_kwargs, "chat template flags")}
    tools = None if tools is None else plain_data(list(tools), "tools")
    template = compile_template(str(source))
    try:
        return tb.run_budgeted(budget, lambda: template.generate(
            messages=msgs, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **ctx))
    except tb.BudgetExceeded as e:
        name = where or getattr(source, "origin", None) or "the chat template (given as text)"
        raise ChatTemplateBudgetError(f"{name}: chat template rendering stopped: {e} (budget: {budget.seconds} s, "
                                      f"{budget.chars} characters)") from None


def _pick(templates: Union[str, list, dict], where: str, with_tools: bool) -> str:
    """tokenizer_config's chat_template may be one string or named templates ('default', 'tool_use')."""
    if isinstance(templates, str):
        return templates
    if isinstance(templates, list):
        templates = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
    if not isinstance(templates, dict):
        raise ValueError(f"{where}: chat_template must be a string or a list of named templates")
    if with_tools and isinstance(templates.get("tool_use"), str):
        return templates["tool_use"]
    if isinstance(templates.get("default"), str):
        return templates["default"]
    raise ValueError(f"{where}: several chat templates {sorted(map(str, templates))} and none named 'default'")


class TemplateSource:
    """Where a tokenizer's template comes from: chat_template.jinja beats tokenizer_config.json."""

    def __init__(self, directory: str, config: dict):
        self.directory = directory
        self.where = os.path.join(directory, CONFIG_FILE)  # the file the template comes from
        self._templates: Optional[Union[str, list, dict]] = None
        jinja_file = os.path.join(directory, TEMPLATE_FILE)
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                self._templates, self.where = f.read(), jinja_file
        elif config.get("chat_template") is not None:
            self._templates = config["chat_template"]

    @property
    def present(self) -> bool:
        return self._templates is not None

    def template(self, with_tools: bool = False) -> str:
        if self._templates is None:
            raise MissingChatTemplateError(
                f"{os.path.join(self.directory, CONFIG_FILE)}: no 'chat_template' (and no {TEMPLATE_FILE} beside it), "
                "but the prompts are chat messages; give the tokenizer a template or set data.chat_template "
                "(a Jinja template or a path to one)")
        return TemplateText(_pick(self._templates, self.where, with_tools), self.where)


def resolve_override(spec: Optional[str]) -> Optional[str]:
    """data.chat_template: a path to a template file, or the template text itself."""
    if not spec:
        return None
    if "{{" in spec or "{%" in spec:
        return TemplateText(spec, "data.chat_template (inline text)")
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"data.chat_template={spec!r}: no such template file (nor is it Jinja text)")
    with open(spec, encoding="utf-8") as f:
        return TemplateText(f.read(), spec)


# The built-in tokenizer's format as a template: a lone user message is used verbatim (the
# synthetic task's prompts), anything longer becomes "role: content" lines and an assistant cue.
BUILTIN_CHAT_TEMPLATE = (
    "{%- if messages | length == 1 and messages[0].role == 'user' and not tools -%}"
    "{{ messages[0].content }}"
    "{%- else -%}"
    "{%- for m in messages -%}{{ m.role }}: {{ m.content }}\n{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
    "{%- endif -%}"
)
