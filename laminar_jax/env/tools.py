"""Tool calls in the Qwen2.5 / Hermes format, and tool messages rendered back to the policy.

A policy turn calls tools by writing, anywhere in its text,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}
    </tool_call>

(arguments may also be a JSON string holding the object, as some models write). Generation
stops at the end of the call (`TOOL_CALL_END` is the stop string). The result goes back as a
`tool` message: through the tokenizer's chat template when it has one, otherwise in the plain
format `PLAIN_TOOL_FORMAT` (Qwen2.5's own rendering of a tool message).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple, Optional

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PLAIN_TOOL_FORMAT = "<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.S)


class ToolCall(NamedTuple):
    name: str
    arguments: dict


class ToolCallError(ValueError):
    """A <tool_call> block that is not {"name": str, "arguments": object} JSON."""


def _one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call is not JSON ({e.msg} at char {e.pos}): {body.strip()!r:.200}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError(f"tool call needs a string 'name': {body.strip()!r:.200}")
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError(f"tool call {obj['name']!r}: 'arguments' string is not JSON: {args!r:.200}") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"tool call {obj['name']!r}: 'arguments' must be an object, got {args!r:.200}")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every complete <tool_call>...</tool_call> block of `text`, in order (raises ToolCallError on a bad one)."""
    return [_one(m.group(1)) for m in _CALL.finditer(text)]


def has_open_call(text: str) -> bool:
    """A <tool_call> opened and never closed (generation ran out inside it)."""
    return text.rfind(TOOL_CALL_START) > text.rfind(TOOL_CALL_END)


def calls_tool(response_ids, policy_mask, start_ids) -> bool:
    """Whether the policy tokens of a trajectory hold `start_ids` (the ids of TOOL_CALL_START) in a row."""
    ids, mask, k = list(response_ids), list(policy_mask), len(start_ids)
    start = list(start_ids)
    return k > 0 and any(ids[i:i + k] == start and all(mask[i:i + k]) for i in range(len(ids) - k + 1))


def render_tool_message(content: str, tokenizer: Optional[Any] = None, chat_template: Optional[str] = None) -> str:
    """The text of a tool message followed by the next assistant turn's header.

    With a tokenizer (the project's protocol, laminar_jax.model.tokenizer): its chat template's
    rendering of [user, assistant, tool] + generation prompt minus that of [user, assistant], i.e.
    exactly what the template appends for the tool message. Without one, or when the template
    does not extend the conversation by appending (or refuses a 'tool' role): PLAIN_TOOL_FORMAT.
    """
    if tokenizer is not None:
        from laminar_jax.model.chat_template import ChatTemplateBudgetError

        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        try:
            base = tokenizer.apply_chat_template(head, add_generation_prompt=False, chat_template=chat_template)
            full = tokenizer.apply_chat_template(head + [{"role": "tool", "content": content}],
                                                 add_generation_prompt=True, chat_template=chat_template)
        except ChatTemplateBudgetError:
            raise  # a runaway template is an error, not a template without tool support
        except Exception:  # noqa: BLE001 - a template without tool support: the documented plain format
            full, base = "", None
        if base is not None and full.startswith(base) and content in full[len(base):]:
            return full[len(base):]
    return PLAIN_TOOL_FORMAT.format(content=content)
