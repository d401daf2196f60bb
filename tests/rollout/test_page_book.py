"""The engine's host page book (rollout/page_book.py): reservations all or none, a slot's life
(claim, park, detach, attach, grow, resume, release) and what the next generate() call runs."""

import dataclasses

import numpy as np
import pytest

from laminar_jax.rollout.page_book import PageBook
from laminar_jax.rollout.paged import OutOfPages
from laminar_jax.rollout.schedule import DecodeSchedule
from tests.rollout.rollout_helpers import SECTION


def _book(num_pages: int = 20, **section) -> PageBook:
    sec = dataclasses.replace(SECTION, num_pages=num_pages, **section)
    return PageBook(sec.num_pages, DecodeSchedule.of(sec, "cpu", uses_live_pages=True))


def test_reserve_all_takes_every_sequence_or_none():
    book = _book()
    per = book.schedule.reserve_pages(9, 20)
    free = book.allocator.num_free
    with pytest.raises(OutOfPages):
        book.reserve_all([(9, 20)] * (free // per + 1))
    assert book.allocator.num_free == free  # the ones that fitted went back
    taken = book.reserve_all([(9, 20), (9, 20)])
    assert [len(p) for p in taken] == [per, per] and book.allocator.num_free == free - 2 * per


def test_a_slot_life_keeps_pages_and_decoding_slots_apart():
    book = _book(decode_chunk=2)  # compaction: the rows are the decoding slots, in chunks of 2
    free = book.allocator.num_free
    pages = book.admit(2, 9, 20, 8)
    with pytest.raises(ValueError, match="slot 2 is occupied"):
        book.admit(2, 9, 20, 8)
    assert book.allocator.num_free == free - len(pages)  # the refusal took nothing
    book.admit(0, 5, 4, 4)
    rows, chunks = book.rows()
    assert [int(r) for r in rows[:2]] == [0, 2] and int(chunks) == 1
    book.advance()
    assert book.cached_hi == {2: 8 + book.schedule.steps_per_call, 0: 4 + book.schedule.steps_per_call}
    book.park(2)  # waits on its environment: pages kept, not decoding
    assert 2 in book.slot_pages and 2 not in book.cached_hi and int(book.rows()[0][0]) == 0
    assert int(book.rows()[0][1]) == book.schedule.num_slots  # padding: slot 2 no longer decodes
    held = book.detach(2)
    assert held == pages and 2 not in book.slot_pages and book.allocator.num_free == free - len(pages) - len(
        book.slot_pages[0])
    book.attach(5, held)
    grown = book.grow(5, len(held) + 1)
    assert grown[:len(held)] == held and len(grown) == len(held) + 1
    np.testing.assert_array_equal(book.page_row(5)[:len(grown)], grown)
    book.resume(5, 12)
    assert book.cached_hi[5] == 12 and book.live_bucket() >= 1
    book.release(5)
    book.release(0)
    assert not book.slot_pages and not book.cached_hi and book.allocator.num_free == free
