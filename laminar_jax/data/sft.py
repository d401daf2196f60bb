"""Supervised (prompt, response) pairs for the warm-start: from the synthetic task or from a file.

A file row is a prompt row (``prompt``: a string used verbatim, or chat messages rendered through
the chat template, as for RL) with a ``response`` string: the supervised target. Prompt ids are
built exactly as the RL prompts are (BOS, template, data.max_prompt_tokens policy), so the model
is warm-started on the format RL will show it; the response gets EOS appended.

A multi-turn trace (an episode's policy turns with the observations between them) is a list of
strings, ``response: [turn, observation, turn, ...]``: each piece is encoded on its own, as an
episode encodes them, and only the turns are trained on. An observation is context, as in RL,
never a target (a tool's result is not something the policy should learn to predict). Such a
row gives a triple (prompt_ids, response_ids, loss_mask) instead of a pair.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from laminar_jax.data.config import DataSection
from laminar_jax.data.records import BadRowError, Prompt

Pair = tuple  # (prompt_ids, response_ids) or (prompt_ids, response_ids, loss_mask over response_ids)


def _response(raw: Any, where: str) -> Union[str, list[str]]:
    resp = raw.get("response") if isinstance(raw, dict) else None
    if isinstance(resp, list):
        if len(resp) % 2 == 1 and all(isinstance(x, str) for x in resp) and any(resp[::2]):
            return resp
        raise BadRowError(where, "'response' as a list must hold strings [turn, observation, ..., turn] (an odd "
                          f"number, a non-empty turn among them), got {resp!r:.200}")
    if not isinstance(resp, str) or not resp:
        raise BadRowError(where, "'response' must be a non-empty string (the supervised target) or a list "
                          f"[turn, observation, ..., turn], got {resp!r:.200}")
    return resp


def _response_ids(resp: Union[str, list[str]], tokenizer) -> tuple[list[int], Optional[list[int]]]:
    """Response ids + EOS, and for a multi-turn trace the loss mask (1 on turns and EOS, 0 on observations)."""
    if isinstance(resp, str):
        return list(tokenizer.encode(resp)) + [tokenizer.eos_id], None
    ids, mask = [], []
    for k, piece in enumerate(resp):
        piece_ids = list(tokenizer.encode(piece))
        ids += piece_ids
        mask += [1 - k % 2] * len(piece_ids)
    return ids + [tokenizer.eos_id], mask + [1]


def _file_pairs(section: DataSection, tokenizer, max_total_len: int) -> tuple[list[Pair], dict]:
    from laminar_jax.data.files import read_rows
    from laminar_jax.data.rows import build_prompt
    from laminar_jax.data.source import chat_options

    chat, pairs = chat_options(section), []
    counts = {"rows": 0, "bad_rows_skipped": 0, "overlong_filtered": 0, "response_truncated": 0}
    for index, (where, raw) in enumerate(read_rows(section.path or "")):
        counts["rows"] += 1
        row = dict(raw, reward_model=raw.get("reward_model") or {"ground_truth": ""}) if isinstance(raw, dict) else raw
        try:
            resp = _response(raw, where)
            out = build_prompt(row, where, dataset="sft", index=index, epoch=0, tokenizer=tokenizer,
                               max_prompt_tokens=section.max_prompt_tokens, overlong=section.overlong,
                               add_bos=section.add_bos, chat=chat)
        except BadRowError as e:
            out = e
        if not isinstance(out, Prompt):
            bad = isinstance(out, BadRowError) or out.kind == "bad_row"
            if bad and not section.skip_bad_rows:
                raise out if isinstance(out, BadRowError) else BadRowError(out.where, out.message)
            if not bad and section.overlong == "error":
                raise ValueError(f"{out.where}: {out.message}")
            counts["bad_rows_skipped" if bad else "overlong_filtered"] += 1
            continue
        ids, mask = _response_ids(resp, tokenizer)
        room = max_total_len - len(out.prompt_ids)
        if len(ids) > room:  # a trajectory never exceeds rollout.max_total_len; train on what fits
            ids, counts["response_truncated"] = ids[:max(room, 0)], counts["response_truncated"] + 1
            mask = None if mask is None else mask[:len(ids)]
        if ids and (mask is None or any(mask)):
            pairs.append((list(out.prompt_ids), ids) if mask is None else (list(out.prompt_ids), ids, mask))
    return pairs, counts


def _synthetic_pairs(section: DataSection, tokenizer, seed: int, n: int = 2048) -> list[Pair]:
    from laminar_jax.data.source import skew_task
    from laminar_jax.data.synthetic_skew import sft_examples

    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None and section.add_bos else []
    return [(bos + list(tokenizer.encode(p)), list(tokenizer.encode(r)) + [tokenizer.eos_id])
            for p, r in sft_examples(n, seed=seed, task=skew_task(section))]


def sft_pairs(section: DataSection, tokenizer, *, max_total_len: int, seed: int) -> tuple[list[Pair], dict]:
    """(pairs, counters) for data.source='synthetic_skew' (generated) or 'file' (rows with 'response')."""
    section.validate("data")
    if section.source == "synthetic_skew":
        pairs = _synthetic_pairs(section, tokenizer, seed)
        return pairs, {"rows": len(pairs)}
    if section.source == "file":
        pairs, counts = _file_pairs(section, tokenizer, max_total_len)
        if not pairs:
            raise ValueError(f"data.path={section.path!r}: no usable (prompt, response) row ({counts})")
        return pairs, counts
    raise ValueError(f"data.source={section.source!r}: supervised pairs come from 'synthetic_skew' or 'file' "
                     "(rows with a 'response' column)")
