"""The prompt iterator: a grain pipeline (shuffle per epoch, repeat, tokenise) with resumable state.

Pipeline: ``range(n) -> shuffle(seed) -> repeat(num_epochs) -> (epoch, row) -> Prompt | Rejected``,
run by grain's prefetching iterator. Rejected rows are counted (or raised) here, in the consumer
thread, so the counters match exactly what was consumed and travel with ``get_state()``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Protocol, Union

import grain

from laminar_jax.data import synthetic_skew
from laminar_jax.data.config import GENERATED_HINT, DataSection
from laminar_jax.data.records import BadRowError, OverlongPromptError, Prompt, Rejected
from laminar_jax.data.rows import ChatOptions, build_prompt

STATE_VERSION = 1
_COUNTERS = ("yielded", "bad_rows_skipped", "overlong_filtered", "overlong_truncated")


class RowSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[str, Any]: ...  # (where, raw row)


class ListRows:
    """Rows already in memory, as (where, raw) pairs."""

    def __init__(self, rows: list[tuple[str, Any]]):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> tuple[str, Any]:
        return self._rows[index]


class SkewRows:
    """synthetic_skew problems as verl-layout rows, generated on access."""

    def __init__(self, task: synthetic_skew.SkewTask, size: int, seed: int, stream: Optional[int] = None):
        self.task, self.size, self.seed = task, size, seed
        self.stream = synthetic_skew._RL_STREAM if stream is None else stream

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[str, Any]:
        problem = synthetic_skew.sample_problem(self.task, self.seed, index, stream=self.stream)
        return f"synthetic_skew row {index}", synthetic_skew.to_row(problem, index, self.seed)


def _to_prompt(epoch_and_row: tuple[int, int], *, rows: RowSource, dataset: str, tokenizer, opts: dict):
    epoch, index = epoch_and_row
    where, raw = rows[index]
    return build_prompt(raw, where, dataset=dataset, index=int(index), epoch=int(epoch), tokenizer=tokenizer, **opts)


class PromptSource:
    """Iterator of Prompt records; ``get_state()``/``set_state()`` resume at exactly the next prompt.

    Bad rows raise BadRowError (or are skipped and counted with ``skip_bad_rows``); over-long prompts
    follow ``overlong``. ``counters`` reports yielded / skipped / filtered / truncated counts.
    """

    def __init__(
        self,
        rows: RowSource,
        tokenizer,
        *,
        dataset: str,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: Optional[int] = None,
        max_prompt_tokens: int = 512,
        overlong: str = "filter",
        skip_bad_rows: bool = False,
        add_bos: bool = True,
        chat: ChatOptions = ChatOptions(),
        read_threads: int = 2,
        prefetch: int = 16,
    ):
        self.num_rows = len(rows)
        if self.num_rows == 0:
            raise ValueError(f"dataset {dataset!r} has no rows")
        if overlong not in ("filter", "truncate", "error"):
            raise ValueError(f"overlong={overlong!r}: must be 'filter', 'truncate' or 'error'")
        self.dataset, self.seed, self.shuffle, self.num_epochs = dataset, seed, shuffle, num_epochs
        self.overlong, self.skip_bad_rows = overlong, skip_bad_rows
        opts = dict(max_prompt_tokens=max_prompt_tokens, overlong=overlong, add_bos=add_bos, chat=chat)
        n = self.num_rows
        ds = grain.MapDataset.range(n)
        if shuffle:
            ds = ds.shuffle(seed=seed)  # grain reseeds each epoch after repeat: new order per epoch
        ds = ds.repeat(num_epochs).map_with_index(lambda i, row: (i // n, int(row)))
        ds = ds.map(functools.partial(_to_prompt, rows=rows, dataset=dataset, tokenizer=tokenizer, opts=opts))
        read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
        self._iter = ds.to_iter_dataset(read).__iter__()
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def __iter__(self) -> "PromptSource":
        return self

    def __next__(self) -> Prompt:
        rejected = 0
        while True:
            item: Union[Prompt, Rejected] = next(self._iter)  # StopIteration after the last epoch
            if isinstance(item, Prompt):
                self._counters["yielded"] += 1
                self._counters["overlong_truncated"] += int(item.truncated)
                return item
            if item.kind == "bad_row":
                if not self.skip_bad_rows:
                    raise BadRowError(item.where, item.message)
                self._counters["bad_rows_skipped"] += 1
            else:
                if self.overlong == "error":
                    raise OverlongPromptError(f"{item.where}: {item.message}")
                self._counters["overlong_filtered"] += 1
            rejected += 1
            if rejected >= self.num_rows:  # a whole epoch in a row: nothing will ever be yielded
                raise ValueError(
                    f"dataset {self.dataset!r}: {rejected} rows in a row were rejected ({self.counters}); "
                    f"no usable prompt in a whole epoch (check data.max_prompt_tokens / data.overlong / the rows)")

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def _fingerprint(self) -> dict:
        return {"dataset": self.dataset, "num_rows": self.num_rows, "seed": self.seed, "shuffle": self.shuffle}

    def get_state(self) -> dict:
        """JSON-serialisable position + counters; restoring it yields exactly the next prompt."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "grain": self._iter.get_state(),
            "counters": dict(self._counters),
        }

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"prompt iterator state: expected version {STATE_VERSION}, got {state!r:.200}")
        if state.get("fingerprint") != self._fingerprint():
            raise ValueError(
                f"prompt iterator state was saved for {state.get('fingerprint')}, this source is {self._fingerprint()}"
            )
        self._iter.set_state(state["grain"])
        self._counters = {k: int(state["counters"].get(k, 0)) for k in _COUNTERS}


def skew_task(section: DataSection) -> synthetic_skew.SkewTask:
    return synthetic_skew.SkewTask(
        repeat_median=section.skew_repeat_median,
        repeat_sigma=section.skew_repeat_sigma,
        max_repeats=section.skew_max_repeats,
        pattern_min=section.skew_pattern_min,
        pattern_max=section.skew_pattern_max,
    )


def _rows_and_name(section: DataSection) -> tuple[RowSource, str]:
    if section.source == "file":
        from laminar_jax.data.files import read_rows

        path = section.path or ""
        stem = os.path.splitext(path)[0] if path.endswith((".parquet", ".jsonl", ".json")) else path
        return ListRows(read_rows(path)), section.name or stem
    if section.source == "reasoning_gym":
        from laminar_jax.data.reasoning_gym_task import ReasoningGymRows

        name = section.reasoning_gym_dataset
        rows = ReasoningGymRows(name, section.dataset_size, section.seed)
        return rows, section.name or f"reasoning_gym/{name}-s{section.seed}"
    if section.source == "synthetic_skew":
        rows = SkewRows(skew_task(section), section.dataset_size, section.seed)
        return rows, section.name or f"synthetic_skew-s{section.seed}"
    raise ValueError(f"data.source={section.source!r}: must be 'synthetic_skew', 'file' or 'reasoning_gym'")


def chat_options(section: DataSection) -> ChatOptions:
    """data.chat_template (a file or Jinja text; None: the tokenizer's own) and data.chat_template_kwargs."""
    from laminar_jax.model.chat_template import resolve_override

    return ChatOptions(resolve_override(section.chat_template), dict(section.chat_template_kwargs))


def build_prompt_source(section: DataSection, tokenizer) -> PromptSource:
    """The configured prompt iterator (validates the section first)."""
    section.validate("data")
    chat = chat_options(section)
    rows, name = _rows_and_name(section)
    return PromptSource(
        rows,
        tokenizer,
        dataset=name,
        seed=section.seed,
        shuffle=section.shuffle,
        num_epochs=section.num_epochs,
        max_prompt_tokens=section.max_prompt_tokens,
        overlong=section.overlong,
        skip_bad_rows=section.skip_bad_rows,
        add_bos=section.add_bos,
        chat=chat,
    )


def build_val_prompts(section: DataSection, tokenizer, max_prompts: int = 0) -> list[Prompt]:
    """The held-out eval prompts, in file order (no shuffle, one epoch), at most `max_prompts`
    (0 = all): data.val_files, or data.val_size prompts of a generated source from their own stream.
    Templating, BOS and the over-long rule are the training prompts' (data.*)."""
    section.validate("data")
    if section.val_files is not None:
        from laminar_jax.data.files import read_rows

        try:
            rows: RowSource = ListRows(read_rows(section.val_files))
        except (FileNotFoundError, ValueError) as e:  # read_rows names data.path; these are the val files
            raise type(e)(str(e).replace("data.path", "data.val_files")) from None
        path = section.val_files
        name = "val/" + os.path.basename(os.path.splitext(path)[0] if path.endswith((".parquet", ".jsonl", ".json"))
                                         else path)
    elif section.has_val() and section.source == "synthetic_skew":
        rows = SkewRows(skew_task(section), section.val_size, section.seed, stream=synthetic_skew.VAL_STREAM)
        name = f"val/synthetic_skew-s{section.seed}"
    elif section.has_val() and section.source == "reasoning_gym":
        from laminar_jax.data.reasoning_gym_task import ReasoningGymRows, val_seed

        seed = val_seed(section.seed)
        rows = ReasoningGymRows(section.reasoning_gym_dataset, section.val_size, seed)
        name = f"val/reasoning_gym/{section.reasoning_gym_dataset}-s{seed}"
    else:
        raise ValueError(f"no held-out prompts: set data.val_files (or data.val_size with {GENERATED_HINT})")
    source = PromptSource(rows, tokenizer, dataset=name, shuffle=False, num_epochs=1,
                          max_prompt_tokens=section.max_prompt_tokens, overlong=section.overlong,
                          skip_bad_rows=section.skip_bad_rows, add_bos=section.add_bos, chat=chat_options(section))
    out: list[Prompt] = []
    for prompt in source:
        out.append(prompt)
        if max_prompts and len(out) >= max_prompts:
            break
    if not out:
        raise ValueError(f"data.val_files={section.val_files!r}: no usable held-out prompt ({source.counters})")
    return out
