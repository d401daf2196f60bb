"""Token-bucket rate limiter for relay links.

Tokens accrue at ``rate`` bytes/s up to ``burst``. ``reserve(n)`` takes n tokens, allowing the
balance to go negative, and returns how long the caller must wait: ``max(0, -tokens / rate)``.
So a long-run send rate converges to ``rate`` and any window of length t carries at most
``burst + rate * t`` bytes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class TokenBucket:
    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"TokenBucket(rate={rate}, burst={burst}): both must be > 0")
        self.rate, self.burst = float(rate), float(burst)
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Take n tokens now; return the seconds to wait before sending them."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            return max(0.0, -self._tokens / self.rate)

    def acquire(self, n: int) -> None:
        delay = self.reserve(n)
        if delay > 0:
            self._sleep(delay)


def make_limiter(rate: int, burst: int) -> Optional[TokenBucket]:
    """A bucket for rate > 0, None (unlimited) for rate == 0."""
    return TokenBucket(rate, burst) if rate > 0 else None
