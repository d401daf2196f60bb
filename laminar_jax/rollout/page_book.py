"""An engine's host page book: which KV pages each slot owns and how far each decoding slot may
have cached, kept on the host so that no engine call reads the device to plan the next one.

``PageBook`` is the page table as the host keeps it: the pool's free list (``allocator``), the
pages each slot owns (``slot_pages``, a sequence's pages for its whole life, reserved on
admission), and for each slot that decodes an upper bound of the device's ``lengths[slot]``
(``cached_hi``: a slot drops out of it when parked on its environment, so decode calls skip it).
From these it answers the next generate() call's rows and live-page bucket (via the engine's
``DecodeSchedule``). The device only ever sees page ids through the page table it is sent.
"""

from __future__ import annotations

import numpy as np

from laminar_jax.rollout.paged import OutOfPages, PageAllocator
from laminar_jax.rollout.schedule import DecodeSchedule
from laminar_jax.rollout.slot_inputs import page_row


class PageBook:
    """Host page bookkeeping of one engine. Not thread-safe: the engine's owner calls it."""

    def __init__(self, num_pages: int, schedule: DecodeSchedule):
        self.allocator = PageAllocator(num_pages)
        self.schedule = schedule  # reservations, rows and live buckets follow its knobs
        self.slot_pages: dict[int, list[int]] = {}  # slot -> the KV pages it owns
        self.cached_hi: dict[int, int] = {}  # decoding slot -> upper bound of the device's lengths[slot]

    def reserve(self, prompt_len: int, max_new: int) -> list[int]:
        """Pages for a sequence's whole life (DecodeSchedule.reserve_pages); OutOfPages when short."""
        return self.allocator.allocate(self.schedule.reserve_pages(prompt_len, max_new))

    def reserve_all(self, lengths: list[tuple[int, int]]) -> list[list[int]]:
        """reserve() of each (prompt_len, max_new), or none: OutOfPages leaves the pool as it was."""
        taken: list[list[int]] = []
        try:
            for prompt_len, max_new in lengths:
                taken.append(self.reserve(prompt_len, max_new))
        except OutOfPages:
            for pages in taken:
                self.allocator.free(pages)
            raise
        return taken

    def admit(self, slot: int, prompt_len: int, max_new: int, num_cached: int) -> list[int]:
        """Reserve a free slot's pages and claim them (the checks come before any allocation)."""
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied; free({slot}) first")
        return self.claim(slot, self.reserve(prompt_len, max_new), num_cached)

    def claim(self, slot: int, pages: list[int], num_cached: int) -> list[int]:
        """The slot owns ``pages`` and decodes with (at most) num_cached tokens cached; returns pages."""
        self.slot_pages[slot] = pages
        self.cached_hi[slot] = num_cached
        return pages

    def release(self, slot: int) -> None:
        """The slot's pages go back to the pool; it holds nothing."""
        self.allocator.free(self.slot_pages.pop(slot))
        self.cached_hi.pop(slot, None)

    def park(self, slot: int) -> None:
        """The slot keeps its pages but stops decoding (waits on its environment)."""
        self.cached_hi.pop(slot, None)

    def detach(self, slot: int) -> list[int]:
        """The slot gives its pages up without freeing them (returned, still allocated)."""
        self.park(slot)
        return self.slot_pages.pop(slot)

    def attach(self, slot: int, pages: list[int]) -> None:
        """Detached pages held by a free slot again, not decoding until resume()."""
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied")
        self.slot_pages[slot] = list(pages)

    def grow(self, slot: int, num_pages: int) -> list[int]:
        """The slot owns at least num_pages pages (more taken from the pool); its pages."""
        have = self.slot_pages[slot]
        if num_pages > len(have):
            have.extend(self.allocator.allocate(num_pages - len(have)))
        return have

    def resume(self, slot: int, num_cached: int) -> None:
        """A held slot decodes again with num_cached tokens cached."""
        self.cached_hi[slot] = num_cached

    def page_row(self, slot: int) -> np.ndarray:
        """The slot's page-table row, i32[pages_per_seq] (unused entries the null page)."""
        return page_row(self.schedule.pages_per_seq, self.slot_pages[slot])

    def rows(self) -> tuple[np.ndarray, np.int32]:
        """The next generate() call's rows and chunk count (DecodeSchedule.rows of the decoding slots)."""
        return self.schedule.rows(list(self.cached_hi))

    def live_bucket(self) -> int:
        """Static live-page count the next generate() compiles for (DecodeSchedule.live_bucket)."""
        return self.schedule.live_bucket(self.cached_hi, self.slot_pages)

    def advance(self) -> None:
        """A generate() call was issued: each decoding slot may have cached steps_per_call more tokens."""
        k = self.schedule.steps_per_call
        for slot in self.cached_hi:
            self.cached_hi[slot] += k
