"""What a run shows a person: start-up phases, then one line per learner step.

In a terminal the step lines are a live display (rich): step N of total, reward, tokens/s,
staleness, a slot bar per rollout server and the ETA, redrawn in place. Piped or in CI exactly one
plain line per step is printed, with no line break inside it (a terminal may still wrap it).
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def eta(done: int, total: int, elapsed_s: float) -> str:
    """Remaining time at the mean pace so far, as '1h02m', '3m05s' or '12s' ('?' before the first step)."""
    if done <= 0 or total <= done:
        return "?" if total > done else "0s"
    s = int(round(elapsed_s / done * (total - done)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def slot_bar(used: int, total: int, width: int = 8) -> str:
    full = 0 if total <= 0 else round(width * used / total)
    return "#" * full + "." * (width - full)


class Console:
    def __init__(self, enabled: bool, t0: float, stream: Optional[TextIO] = None, live: Optional[bool] = None):
        self.enabled, self.t0 = enabled, t0
        self.stream = stream or sys.stdout
        self.live = self.enabled and (self.stream.isatty() if live is None else live)
        self._live = None

    def phase(self, what: str) -> None:
        """A start-up phase begins (warm-start, compiling, servers up): one line, so nothing is silent."""
        if self.enabled:
            print(f"[{time.time() - self.t0:7.1f}s] {what}", file=self.stream, flush=True)

    def step(self, step: int, total: int, rec: dict, tokens_per_s: float, servers: list, queue: int,
             elapsed_s: float) -> None:
        if not self.enabled:
            return
        fields = (f"step {step:4d}/{total} reward {rec.get('reward_mean', float('nan')):.3f} "
                  f"tok/s {tokens_per_s:7.0f} staleness {rec.get('staleness_mean', 0.0):.2f} "
                  f"queue {queue} eta {eta(step, total, elapsed_s)}")
        if not self.live:
            slots = " ".join(f"{s.slots_used}/{s.slots_total}" for s in servers)
            print(f"{fields} slots {slots}", file=self.stream, flush=True)
            return
        self._render(fields, servers)

    def _render(self, fields: str, servers: list) -> None:
        from rich.console import Console as RichConsole
        from rich.console import Group
        from rich.live import Live
        from rich.text import Text

        lines = [Text(fields, style="bold")]
        lines += [Text(f"  {s.server_id:>12s} v{s.version:<4d} [{slot_bar(s.slots_used, s.slots_total)}] "
                       f"{s.slots_used}/{s.slots_total}") for s in servers]
        if self._live is None:
            self._live = Live(Group(*lines), console=RichConsole(file=self.stream), auto_refresh=False)
            self._live.start()
        self._live.update(Group(*lines), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
