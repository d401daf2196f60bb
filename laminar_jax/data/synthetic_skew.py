"""`synthetic_skew`: a tiny copy-and-count task whose required response length is heavy-tailed.

Task. A prompt ``"{pattern}*{C[k]}="`` asks for ``pattern`` written ``k`` times, each copy followed
by a countdown symbol ``C[k-1], C[k-2], ..., C[0]``, where ``C = "0123456789ABC...XYZ"``. The
response ends with EOS right after ``C[0]`` ("0"). Example: prompt ``"ab*4="`` ->
response ``"ab3ab2ab1ab0"``.

Every next character follows from a short look-back (copy the pattern from the prompt or the
previous copy; a counter symbol is its predecessor's predecessor in ``C``; stop after "0"), so a
2-layer character model can learn it, while the *length* ``k * (len(pattern) + 1)`` is skewed:
``k = clip(round(median * exp(sigma * z)), 1, max_repeats)``, ``z ~ N(0, 1)``, pattern length
uniform in ``[pattern_min, pattern_max]`` over letters a-z.

Reward (graded, from the response text alone plus the target):

    reward = max(0, 1 - levenshtein(response, target) / len(target))

so a perfect response scores 1, an empty one 0, a response that stops early after a correct
prefix of length ``m`` scores ``m / len(target)``, and each extra (overshoot) or wrong character
costs ``1 / len(target)``; a model that never emits EOS runs over and loses credit per character.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Optional

import numpy as np

DATA_SOURCE = "synthetic_skew"
COUNTER = string.digits + string.ascii_uppercase  # 36 symbols: repeat counts up to 35
PATTERN_CHARS = string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class SkewTask:
    """Parameters of the synthetic_skew distribution (see module docstring)."""

    repeat_median: float = 3.0
    repeat_sigma: float = 1.0
    max_repeats: int = 32
    pattern_min: int = 1
    pattern_max: int = 3

    def __post_init__(self):
        if not 1 <= self.max_repeats < len(COUNTER):
            raise ValueError(f"max_repeats={self.max_repeats}: must be in [1, {len(COUNTER) - 1}]")
        if not 1 <= self.pattern_min <= self.pattern_max:
            raise ValueError(f"pattern_min={self.pattern_min}, pattern_max={self.pattern_max}: need 1 <= min <= max")


@dataclasses.dataclass(frozen=True)
class SkewProblem:
    """One problem: the prompt, the pattern, the repeat count and the exact target response."""

    prompt: str
    pattern: str
    repeats: int
    target: str


def make_target(pattern: str, repeats: int) -> str:
    """``pattern + C[repeats-1] + pattern + C[repeats-2] + ... + pattern + C[0]``."""
    return "".join(pattern + COUNTER[j] for j in range(repeats - 1, -1, -1))


def make_prompt(pattern: str, repeats: int) -> str:
    return f"{pattern}*{COUNTER[repeats]}="


_RL_STREAM, _SFT_STREAM = 0x5CE3, 0x5F70
VAL_STREAM = 0x5A11  # held-out eval prompts (data.val_size): neither the RL nor the SFT stream


def sample_problem(task: SkewTask, seed: int, index: int, stream: int = _RL_STREAM) -> SkewProblem:
    """Deterministic in (seed, index, stream), so a dataset of problems supports random access."""
    rng = np.random.default_rng([int(seed), int(index), int(stream)])
    z = rng.standard_normal()
    k = int(np.clip(np.rint(task.repeat_median * np.exp(task.repeat_sigma * z)), 1, task.max_repeats))
    n = int(rng.integers(task.pattern_min, task.pattern_max + 1))
    pattern = "".join(PATTERN_CHARS[int(i)] for i in rng.integers(0, len(PATTERN_CHARS), n))
    return SkewProblem(make_prompt(pattern, k), pattern, k, make_target(pattern, k))


def to_row(problem: SkewProblem, index: int, seed: int) -> dict[str, Any]:
    """A verl-layout row: chat prompt, ground truth = target response."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "reward_model": {"ground_truth": problem.target, "style": "rule"},
        "extra_info": {"index": index, "seed": seed, "pattern": problem.pattern, "repeats": problem.repeats},
    }


def target_length(ground_truth: str) -> int:
    """Required response length in characters (= tokens for the builtin tokenizer), EOS excluded."""
    return len(ground_truth)


def target_length_for_prompt(prompt: str) -> int:
    """Required response length from the prompt text alone: ``repeats * (len(pattern) + 1)``."""
    pattern, repeats = parse_prompt(prompt)
    return repeats * (len(pattern) + 1)


def parse_prompt(prompt: str) -> tuple[str, int]:
    """``"ab*4="`` -> ("ab", 4); raises ValueError naming the prompt when malformed."""
    body = prompt.strip()
    if not (body.endswith("=") and "*" in body):
        raise ValueError(f"not a synthetic_skew prompt: {prompt!r}")
    pattern, _, count = body[:-1].rpartition("*")
    if len(count) != 1 or count not in COUNTER or not pattern:
        raise ValueError(f"not a synthetic_skew prompt: {prompt!r}")
    return pattern, COUNTER.index(count)


def levenshtein(a: str, b: str, limit: Optional[int] = None) -> int:
    """Edit distance (insert/delete/substitute cost 1), capped at ``limit`` when one is given.

    Why not the textbook table: this is the task's reward, scored for every trajectory, and a
    Python double loop costs O(len(a) * len(b)) interpreted steps (~1.5 ms at 64 x 64 characters).
    Myers' bit-vector algorithm (Hyyro's form for the global distance) keeps a column of the table
    as two bit masks of len(a) bits and advances it by one character of b in a few integer
    operations; Python's integers hold any length. Same distances (tests/data/test_synthetic_skew.py
    checks it against the table on random strings).
    """
    if len(a) < len(b):
        a, b = b, a
    m = len(a)
    if not b:
        d = m
    else:
        full, top = (1 << m) - 1, 1 << (m - 1)
        peq: dict = {}
        for i, c in enumerate(a):
            peq[c] = peq.get(c, 0) | (1 << i)
        pv, mv, d = full, 0, m  # column 0 of the table: 0, 1, ..., m (every vertical step +1)
        for c in b:
            eq = peq.get(c, 0)
            xv = eq | mv
            xh = (((eq & pv) + pv) ^ pv) | eq
            ph = mv | (~(xh | pv) & full)
            mh = pv & xh
            if ph & top:
                d += 1
            elif mh & top:
                d -= 1
            ph = ((ph << 1) | 1) & full  # row 0 of the table grows by 1 per character of b
            mh = (mh << 1) & full
            pv = mh | (~(xv | ph) & full)
            mv = ph & xv
    return d if limit is None else min(d, limit)


def skew_reward(response: str, ground_truth: Any, extra_info: Any = None) -> float:
    """``max(0, 1 - levenshtein(response, target) / len(target))`` (see module docstring)."""
    target = str(ground_truth)
    if not target:
        raise ValueError("synthetic_skew ground_truth must be a non-empty target response")
    response = response.strip()
    t = len(target)
    if len(response) >= 2 * t:  # distance >= len(response) - t >= t: no credit, skip the distance
        return 0.0
    return max(0.0, 1.0 - levenshtein(response, target, limit=t) / t)


def sft_examples(n: int, seed: int, task: Optional[SkewTask] = None) -> list[tuple[str, str]]:
    """``n`` (prompt_text, response_text) pairs for a supervised warm-start (append EOS yourself).

    Same distribution as the RL prompts, drawn from a separate random stream.
    """
    task = task or SkewTask()
    out = []
    for i in range(n):
        p = sample_problem(task, seed, i, stream=_SFT_STREAM)
        out.append((p.prompt, p.target))
    return out
