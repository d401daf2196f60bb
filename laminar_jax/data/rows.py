"""Pure row logic: validate a verl-layout row, render and tokenise its prompt, apply the length policy."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple, Optional, Union

from laminar_jax.data.records import BadRowError, Prompt, Rejected, RowSpec, make_uid


class ChatOptions(NamedTuple):
    """How chat-message prompts are rendered: the template (None: the tokenizer's own) and its flags."""

    template: Optional[str] = None  # Jinja text (data.chat_template, already read from its file)
    kwargs: dict = {}  # data.chat_template_kwargs, e.g. {"enable_thinking": False}
    add_generation_prompt: bool = True


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def parse_row(raw: Any, where: str) -> RowSpec:
    """Check one row's columns; raises BadRowError(where, problem) on anything malformed.

    Columns: ``data_source`` str, ``prompt`` non-empty str or non-empty list of
    ``{"role": str, "content": str, ...}`` (other JSON keys such as ``tool_calls`` pass through to
    the template; ``content`` may be missing only beside ``tool_calls``), ``reward_model`` dict with
    a non-null ``ground_truth``, ``extra_info`` dict or missing/null, ``tools`` (optional) a list of
    JSON-schema objects given to the chat template.
    """
    if isinstance(raw, BadRowError):
        raise raw
    if not isinstance(raw, dict):
        raise BadRowError(where, f"row must be an object, got {type(raw).__name__}")
    ds = raw.get("data_source")
    if not isinstance(ds, str) or not ds:
        raise BadRowError(where, f"'data_source' must be a non-empty string, got {ds!r}")
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRowError(where, "'prompt' is an empty string")
    elif isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            content_ok = isinstance(m, dict) and (
                isinstance(m.get("content"), str) or (m.get("content") is None and bool(m.get("tool_calls"))))
            if not (content_ok and isinstance(m.get("role"), str) and _json_ok(m)):
                raise BadRowError(where, f"'prompt'[{i}] must be {{'role': str, 'content': str}}, got {m!r}")
    else:
        raise BadRowError(where, f"'prompt' must be a string or a non-empty list of chat messages, got {prompt!r}")
    rm = raw.get("reward_model")
    if not isinstance(rm, dict):
        raise BadRowError(where, f"'reward_model' must be an object with 'ground_truth', got {rm!r}")
    gt = rm.get("ground_truth")
    if gt is None:
        raise BadRowError(where, "'reward_model.ground_truth' is missing")
    if not _json_ok(gt):
        raise BadRowError(where, f"'reward_model.ground_truth' is not JSON-serialisable: {gt!r}")
    extra = raw.get("extra_info")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict) or not _json_ok(extra):
        raise BadRowError(where, f"'extra_info' must be a JSON-serialisable object, got {extra!r}")
    tools = raw.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
                                  and _json_ok(tools)):
        raise BadRowError(where, f"'tools' must be a list of JSON-schema objects, got {tools!r:.200}")
    if tools is not None and isinstance(prompt, str):
        raise BadRowError(where, "'tools' needs a chat-message 'prompt' (a plain string is used verbatim)")
    messages = prompt if isinstance(prompt, str) else [dict(m) for m in prompt]
    return RowSpec(ds, messages, gt, extra, tools or None)


def _row_specific(e: Exception) -> bool:
    """A template that rejects these messages (raise_exception, bad message) vs one that cannot run at all."""
    import jinja2

    from laminar_jax.model.chat_template import MissingChatTemplateError

    if isinstance(e, (MissingChatTemplateError, jinja2.TemplateSyntaxError)):
        return False
    return isinstance(e, (jinja2.TemplateError, ValueError, TypeError))


def render_prompt(prompt: Union[str, list], tokenizer, chat: ChatOptions = ChatOptions(), tools=None) -> str:
    """A plain string is used verbatim (already templated); chat messages go through the chat template."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=chat.add_generation_prompt,
                                         chat_template=chat.template, **chat.kwargs)


def build_prompt(
    raw: Any,
    where: str,
    *,
    dataset: str,
    index: int,
    epoch: int,
    tokenizer,
    max_prompt_tokens: int,
    overlong: Literal["filter", "truncate", "error"],
    add_bos: bool,
    chat: ChatOptions = ChatOptions(),
) -> Union[Prompt, Rejected]:
    """Row -> Prompt, or Rejected("bad_row" | "overlong", message naming the row).

    BOS: with add_bos it is prepended unless the ids already start with it (templates such as
    Llama-3's write ``{{ bos_token }}`` themselves; it is never doubled).
    'truncate' keeps a leading BOS and the *last* tokens (the question and the
    assistant turn sit at the end of a chat prompt); the text is re-decoded from the kept ids.
    """
    try:
        spec = parse_row(raw, where)
    except BadRowError as e:
        return Rejected("bad_row", e.where, e.problem)
    try:
        text = render_prompt(spec.prompt, tokenizer, chat, spec.tools)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception() is about this row
        if not _row_specific(e):
            raise
        return Rejected("bad_row", where, f"chat template: {e}")
    ids = list(tokenizer.encode(text))
    bos_id = tokenizer.bos_id
    if add_bos and bos_id is not None and ids[:1] != [bos_id]:
        ids = [bos_id] + ids
    bos = [bos_id] if bos_id is not None and ids[:1] == [bos_id] else []
    truncated = False
    if len(ids) > max_prompt_tokens:
        if overlong != "truncate":
            return Rejected("overlong", where, f"prompt has {len(ids)} tokens > max_prompt_tokens={max_prompt_tokens}")
        keep = max_prompt_tokens - len(bos)
        ids = bos + ids[len(ids) - keep :] if keep > 0 else ids[:max_prompt_tokens]
        text = tokenizer.decode(ids)
        truncated = True
    return Prompt(
        uid=make_uid(dataset, index, epoch),
        index=index,
        epoch=epoch,
        data_source=spec.data_source,
        prompt_text=text,
        prompt_ids=[int(i) for i in ids],
        ground_truth=spec.ground_truth,
        extra_info=spec.extra_info,
        truncated=truncated,
    )
