"""The decode schedule: how an engine lays its prompts and live slots out into device calls.

One frozen object holds the knobs (prompt buckets, tokens per call, compaction chunks, row buckets,
live-page buckets, packed prefill widths) and answers which bucket a prompt pads to, how many pages
a sequence reserves, and, from the engine's host bookkeeping alone (which slots
hold a sequence and an upper bound of each one's cached length), which rows the next call runs and
which live-page bucket it compiles for: no device read.

Live-page buckets: the engine keeps, per slot, an upper bound on the device's cached length (set at
insert/import, + steps_per_call after every generate(), whether or not the slot still runs), so it
knows how many pages the next call can attend; the schedule rounds the total up to a bucket (at
most rows x pages_per_seq). The device also counts the real live pages and reports
``StepOutput.overflow``; the server raises on it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.paged import pages_needed

# Tokens per slot per generate() call where rollout.decode_steps_per_call is 0 ('auto'): on an
# accelerator each call is a host round trip (dispatch, then the host reads the step's tokens), so
# a scan of several steps amortises it; the CPU computes on the host's own cores, where one step per
# call lets admissions and retirements follow every token (and the demo was tuned at 1).
AUTO_STEPS_PER_CALL = {"cpu": 1}
AUTO_STEPS_ACCELERATOR = 8


def steps_per_call(setting: int, platform: str) -> int:
    """rollout.decode_steps_per_call resolved for an engine on ``platform`` (0 = auto)."""
    return setting if setting > 0 else AUTO_STEPS_PER_CALL.get(platform, AUTO_STEPS_ACCELERATOR)


@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
    num_slots: int
    pages_per_seq: int
    page_size: int
    steps_per_call: int  # tokens per slot per generate() call (a lax.scan of that many steps)
    chunk: int  # rows per compaction chunk; 0 = no compaction (one batch of num_slots rows)
    row_buckets: tuple[int, ...]  # smaller batches for calls with few live slots
    live_buckets: tuple[int, ...]  # live-page counts generate() compiles for; (0,) when attention needs none
    packed_widths: tuple[int, ...]  # token counts prefill_insert_rows() pads its packed prompts to
    buckets: tuple[int, ...]  # prompt lengths prefill() and prefill_insert() compile for

    @classmethod
    def of(cls, section: RolloutSection, platform: str, uses_live_pages: bool) -> "DecodeSchedule":
        buckets = section.buckets()
        rows_per_call = section.decode_chunk or section.num_slots
        live = live_buckets(rows_per_call * section.pages_per_seq, section.live_buckets) if uses_live_pages else (0,)
        return cls(section.num_slots, section.pages_per_seq, section.page_size,
                   steps_per_call(section.decode_steps_per_call, platform), section.decode_chunk,
                   tuple(section.decode_row_buckets), live,
                   packed_widths(buckets[0], buckets[-1], section.prefill_rows), buckets)

    @property
    def uses_live_pages(self) -> bool:
        return self.live_buckets != (0,)

    @property
    def prompt_pages(self) -> int:
        """Pages share_prompt() copies: the most a prompt's KV (all but its last token) fills."""
        return max(1, min(pages_needed(self.buckets[-1] - 1, self.page_size), self.pages_per_seq))

    def bucket_for(self, n: int) -> int:
        """The prompt bucket an n-token prompt pads to; ValueError past the largest."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"prompt of {n} tokens exceeds the largest prefill bucket {self.buckets[-1]}")

    def pad_prompt(self, prompt_ids) -> tuple[np.ndarray, int]:
        """i32[1, bucket] right-padded with 0, and the true length."""
        ids = np.asarray(prompt_ids, np.int32).reshape(-1)
        out = np.zeros((1, self.bucket_for(len(ids))), np.int32)
        out[0, :len(ids)] = ids
        return out, len(ids)

    def reserve_pages(self, prompt_len: int, max_new: int) -> int:
        """Pages a sequence needs for its whole life: KV of prompt + max_new - 1 tokens (the last
        sampled token is never fed)."""
        return pages_needed(prompt_len + max_new - 1, self.page_size)

    @property
    def num_rows(self) -> int:
        """Length of the rows array of the engine's own call (num_slots, rounded up to whole chunks)."""
        per_call = self.chunk or self.num_slots
        return -(-self.num_slots // per_call) * per_call

    def row_bucket(self, live: int) -> int:
        """The smallest row bucket that holds ``live`` slots with a sequence; 0 = the engine's own call shape."""
        return next((b for b in self.row_buckets if b >= live), 0)

    def rows(self, live_slots: list[int]) -> tuple[np.ndarray, np.int32]:
        """(i32[R] slots in chunk order, padded with num_slots; number of chunks to run).

        Without compaction every slot is a row and there is one chunk (R = num_slots). With it,
        the slots that hold a sequence (some may have finished on the device since; they compute
        masked rows), in slot order. When they fit a row bucket, R is that bucket and one chunk runs.
        """
        small = self.row_bucket(len(live_slots))
        rows = np.full((small or self.num_rows,), self.num_slots, np.int32)
        if not (small or self.chunk):
            rows[:self.num_slots] = np.arange(self.num_slots)
            return rows, np.int32(1)
        live = sorted(live_slots)
        rows[:len(live)] = live
        return rows, np.int32(-(-len(live) // (small or self.chunk)))

    def live_bucket(self, cached_hi: dict[int, int], slot_pages: dict[int, list[int]]) -> int:
        """Static live-page count the next generate() compiles for (0 when attention does not use it).

        A slot with cached-length bound c attends, in the next k-step call, positions <= c + k - 1,
        i.e. its logical pages 0 .. (c + k - 1) // page, never more than it reserved.
        """
        if not self.uses_live_pages:
            return 0
        small = self.row_bucket(len(cached_hi))
        if small:  # a row bucket's one program: room for all its rows' pages (see row_cover)
            return self.row_cover(small)
        need = self.live_pages_bound(cached_hi, slot_pages)
        return next(b for b in self.live_buckets if b >= need)

    def row_cover(self, rows: int) -> int:
        """The live-page bucket that holds every page ``rows`` slots can attend (rows * pages_per_seq).

        Row-bucket calls always use it: one program per row bucket instead of one per live-page
        bucket (~2.7 s of compile each at ~100M), for attention over a few more pages in steps whose
        cost is the weight read.
        """
        return next(b for b in self.live_buckets if b >= min(rows * self.pages_per_seq, self.live_buckets[-1]))

    def live_pages_bound(self, cached_hi: dict[int, int], slot_pages: dict[int, list[int]]) -> int:
        """Upper bound on the KV pages one chunk of the next generate() call attends (summed over its slots)."""
        k, ps = self.steps_per_call, self.page_size
        per_slot = [min(len(slot_pages[s]), (cached_hi[s] + k - 1) // ps + 1) for s in sorted(cached_hi)]
        chunk = self.row_bucket(len(cached_hi)) or self.chunk
        if not chunk:
            return sum(per_slot)
        return max((sum(per_slot[i:i + chunk]) for i in range(0, len(per_slot), chunk)), default=0)


def live_buckets(max_entries: int, policy: str = "fine", smallest: int = 16, halves_from: int = 64) -> tuple[int, ...]:
    """Live-page buckets, capped by (and ending at) max_entries.

    'fine': powers of two from ``smallest``, plus 1.5x midpoints from ``halves_from`` up (96, 192, 384, ...).
    'pow2': powers of two from ``smallest``. 'pow4': powers of four from ``smallest``.

    Attention work follows the bucket, not the live count: with powers of two alone a typical
    engine run attended ~1.45x the live pages (measured on the engine bench); the midpoints cut
    that to ~1.2x for a few more compiled programs (only where a bucket is large enough to matter).
    Every bucket is one compiled generate() program, so the coarser policies trade attention
    padding for compile time.
    """
    growth = {"fine": 2, "pow2": 2, "pow4": 4}[policy]
    out, b = [], smallest
    while b < max_entries:
        out.append(b)
        if policy == "fine" and b >= halves_from and b + b // 2 < max_entries:
            out.append(b + b // 2)
        b *= growth
    return tuple(out) + (max_entries,)


def packed_widths(smallest: int, window: int, rows: int) -> tuple[int, ...]:
    """Packed prefill widths for calls of up to ``rows`` prompts of at most ``window`` tokens: powers
    of two from ``smallest`` up to the window, then every multiple of it up to rows x window (none
    for rows = 1). A call pads to the next width, so above the window it wastes less than one
    prompt's worth: powers of two alone padded the first admissions of 32 prompts of 8-31 tokens
    (4 calls of 124-154 tokens) to 704 tokens, multiples of 32 pad them to 608."""
    if rows < 2:
        return ()
    out, b = [], smallest
    while b < window:
        out.append(b)
        b *= 2
    return tuple(out) + tuple(window * i for i in range(1, rows + 1))
