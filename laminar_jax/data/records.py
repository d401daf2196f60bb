"""Plain records that flow out of the data plane."""

from __future__ import annotations

from typing import Any, NamedTuple


class Prompt(NamedTuple):
    """One prompt ready for a rollout server.

    ``uid`` is ``f"{dataset}/{index}@{epoch}"``: unique per dataset row and epoch, so a ledger can
    check exactly-once consumption per epoch across restarts.
    """

    uid: str
    index: int  # row index in the dataset (stable across epochs and shuffles)
    epoch: int
    data_source: str
    prompt_text: str  # after the chat template (and after truncation, if any)
    prompt_ids: list[int]  # BOS included when the tokenizer has one and add_bos is set
    ground_truth: Any  # JSON-serialisable
    extra_info: dict  # JSON-serialisable
    truncated: bool = False


def make_uid(dataset: str, index: int, epoch: int) -> str:
    return f"{dataset}/{index}@{epoch}"


class RowSpec(NamedTuple):
    """A validated verl-layout row, before templating and tokenisation."""

    data_source: str
    prompt: Any  # str (used verbatim) or list of {"role", "content", ...} messages
    ground_truth: Any
    extra_info: dict
    tools: Any = None  # list of JSON-schema tool descriptions for the chat template, or None


class Rejected(NamedTuple):
    """A row the pipeline did not turn into a Prompt; the iterator counts, skips or raises it."""

    kind: str  # "bad_row" | "overlong"
    where: str  # file and row
    message: str


class BadRowError(ValueError):
    """A malformed prompt row; the message names the file and the row."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


class OverlongPromptError(ValueError):
    """A prompt longer than max_prompt_tokens with overlong='error'; names the file and row."""
