"""Pure row logic: validate a verl-layout row, render and tokenise its prompt, apply the length policy."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from laminar_jax.data.records import BadRowError, Prompt, Rejected, RowSpec, make_uid


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def parse_row(raw: Any, where: str) -> RowSpec:
    """Check one row's columns; raises BadRowError(where, problem) on anything malformed.

    Columns: ``data_source`` str, ``prompt`` non-empty str or non-empty list of
    ``{"role": str, "content": str}``, ``reward_model`` dict with a non-null ``ground_truth``,
    ``extra_info`` dict or missing/null.
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
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
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
    messages = prompt if isinstance(prompt, str) else [{"role": m["role"], "content": m["content"]} for m in prompt]
    return RowSpec(ds, messages, gt, extra)


def render_prompt(prompt: Union[str, list], tokenizer) -> str:
    """A plain string is used verbatim (already templated); chat messages go through the template."""
    return prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(prompt)


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
) -> Union[Prompt, Rejected]:
    """Row -> Prompt, or Rejected("bad_row" | "overlong", message naming the row).

    'truncate' keeps BOS and the *last* ``max_prompt_tokens - 1`` tokens (the question and the
    assistant turn sit at the end of a chat prompt); the text is re-decoded from the kept ids.
    """
    try:
        spec = parse_row(raw, where)
    except BadRowError as e:
        return Rejected("bad_row", e.where, e.problem)
    text = render_prompt(spec.prompt, tokenizer)
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    ids = bos + list(tokenizer.encode(text))
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
