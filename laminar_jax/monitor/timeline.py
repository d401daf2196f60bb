"""Per-server slot-occupancy timeline, coloured by weight version, with publishes marked."""

from __future__ import annotations

import threading
from typing import Optional, Sequence


class Timeline:
    """Samples of (t, server, slots_used, version[, KV pages used/total]) plus publish events; thread-safe."""

    def __init__(self, t0: float):
        self.t0 = t0
        self._lock = threading.Lock()
        self.samples: list[tuple[float, str, int, int, int]] = []  # t, server, used, total, version
        self.publishes: list[tuple[float, int]] = []
        self.kv: list[tuple[float, str, int, int]] = []  # t, server, pages used, pages total
        # Only change points are kept (a run samples every server iteration, ~1e5/min): the
        # latest sample time per server closes each server's last interval.
        self._state: dict[str, tuple] = {}
        self._last_t: dict[str, float] = {}
        self.waiting: list[tuple[float, str, int, int]] = []  # t, server, slots waiting on envs, slots total
        self.env: dict[str, object] = {}  # server -> its EpisodeDriver's latest DriverStats
        # Weight swaps: t (drained and ready to swap), server, stall s (until serving the new
        # version), version, staged ahead (prefetched before the drain ended).
        self.swaps: list[tuple[float, str, float, int, bool]] = []

    def sample(self, t: float, server: str, used: int, total: int, version: int,
               kv_used: Optional[int] = None, kv_total: Optional[int] = None) -> None:
        t = t - self.t0
        with self._lock:
            prev = self._state.get(server, (None, None))
            self._last_t[server] = t
            if prev[0] != (used, total, version):
                self.samples.append((t, server, used, total, version))
            if kv_used is not None and kv_total and prev[1] != (kv_used, kv_total):
                self.kv.append((t, server, kv_used, kv_total))
            self._state[server] = ((used, total, version), (kv_used, kv_total))

    def sample_waiting(self, server: str, waiting: int, env_stats=None) -> None:
        """Slots of `server` whose episode waits on its environment (call right after sample())."""
        with self._lock:
            t = self._last_t.get(server, 0.0)
            total = self._state.get(server, ((0, 1, 0),))[0][1]
            last = next((w for w in reversed(self.waiting) if w[1] == server), None)
            if last is None or last[2] != waiting:
                self.waiting.append((t, server, waiting, total))
            if env_stats is not None:
                self.env[server] = env_stats

    def env_wait_share(self) -> Optional[float]:
        """Time-weighted share of slot-time spent waiting on environments (None without episodes)."""
        with self._lock:
            return _time_weighted(self._closed(self.waiting)) if self.waiting else None

    def _closed(self, points: list) -> list:
        """points plus one closing point per server at its latest sample time (lock held)."""
        last: dict[str, tuple] = {}
        for p in points:
            last[p[1]] = p
        return points + [(self._last_t[s], *p[1:]) for s, p in last.items() if self._last_t[s] > p[0]]

    def swap(self, t: float, server: str, stall_s: float, version: int, staged: bool) -> None:
        """One swap of `server`: ready at `t` (time.time()), serving `version` `stall_s` later."""
        with self._lock:
            self.swaps.append((t - self.t0, server, float(stall_s), int(version), bool(staged)))

    def swap_figures(self) -> dict:
        """The summary's swap figures over every server: stall p50/p99 (s), the share of swaps whose
        version was staged before the drain ended, and the swap count (None figures without swaps)."""
        import numpy as np

        def pct(xs, q):
            return round(float(np.percentile(xs, q)), 5) if xs else None

        with self._lock:
            stalls = [x[2] for x in self.swaps]
            staged = [x[2] for x in self.swaps if x[4]]
        return {"swap_stall_p50_s": pct(stalls, 50), "swap_stall_p99_s": pct(stalls, 99),
                "swap_staged_frac": round(len(staged) / len(stalls), 4) if stalls else None, "swaps": len(stalls),
                # the staged swaps' own median: what is left of a swap once its pull is off the path
                "swap_stall_staged_p50_s": pct(staged, 50)}

    def publish(self, t: float, version: int) -> None:
        with self._lock:
            self.publishes.append((t - self.t0, version))

    def slot_utilization(self) -> float:
        """Time-weighted mean of used/total slots over all servers."""
        with self._lock:
            return _time_weighted([(t, s, used, total) for t, s, used, total, _ in self._closed(self.samples)])

    def kv_utilization(self) -> Optional[float]:
        """Time-weighted mean of used/total KV pages over all servers (None without KV samples)."""
        with self._lock:
            return _time_weighted(self._closed(self.kv)) if self.kv else None

    def relative_to(self, t_start: Optional[float]) -> tuple[list, list]:
        """(closed samples, publishes) with times in seconds since `t_start` (None: since t0)."""
        shift = 0.0 if t_start is None else t_start - self.t0
        with self._lock:
            samples = [(t - shift, *rest) for t, *rest in self._closed(list(self.samples))]
            return samples, [(t - shift, v) for t, v in self.publishes]

    def render(self, path: str, title: str = "", t_start: Optional[float] = None) -> str:
        """Draw the timeline; `t_start` (absolute time, e.g. the RL clock's start) is the axis' zero."""
        import matplotlib
        import matplotlib.cm
        import matplotlib.colors

        samples, publishes = self.relative_to(t_start)
        shift = 0.0 if t_start is None else t_start - self.t0
        with self._lock:
            waiting = [(t - shift, *rest) for t, *rest in self._closed(list(self.waiting))]
            swaps = list(self.swaps)
        servers = sorted({s for _, s, *_ in samples})
        versions = sorted({v for *_, v in samples}) or [0]
        # A colour scale over versions (a legend of 80 entries covered the bars).
        norm = matplotlib.colors.Normalize(vmin=versions[0], vmax=max(versions[-1], versions[0] + 1))
        cmap = matplotlib.colormaps["viridis"]
        color = {v: cmap(norm(v)) for v in versions}
        fig, ax = _figure((10, 1.0 + 0.8 * len(servers)))
        for row, server in enumerate(servers):
            pts = sorted((t, u, tot, v) for t, s, u, tot, v in samples if s == server)
            bars: dict[tuple, list] = {}  # one collection per (height, version), not one per interval
            for (t0, u, tot, v), (t1, *_rest) in zip(pts, pts[1:]):
                if u:
                    bars.setdefault((u / max(tot, 1), v), []).append((t0, t1 - t0))
            for (h, v), xr in bars.items():
                ax.broken_barh(xr, (row, 0.9 * h), color=color[v], linewidth=0)
            _waiting_bars(ax, row, [w for w in waiting if w[1] == server])
            stalls = [(t - shift, d) for t, s, d, *_ in swaps if s == server]
            if stalls:  # each swap's stall, drawn at least a pixel wide: the server serves nothing then
                ax.broken_barh(stalls, (row + 0.9, 0.1), color="black", linewidth=0.8)
        for t, v in publishes:
            ax.axvline(t, color="red", linewidth=0.6, alpha=0.6)
        ax.set_yticks([i + 0.45 for i in range(len(servers))], servers)
        ax.set_xlim(left=0.0)
        ax.set_xlabel("seconds of RL (bar height = slot occupancy; red = publish; black = swap stall"
                      + ("; orange = slots waiting on environments)" if waiting else ")"))
        ax.set_title(title or "rollout slot occupancy")
        fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="weight version", pad=0.01)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


def _waiting_bars(ax, row: int, pts: list) -> None:
    """Overlay, from the bottom of a server's bar, the share of its slots waiting on environments."""
    pts = sorted((t, w, tot) for t, _, w, tot in pts)
    for (t0, w, tot), (t1, *_rest) in zip(pts, pts[1:]):
        if w:
            ax.broken_barh([(t0, t1 - t0)], (row, 0.9 * w / max(tot, 1)), color="orange", alpha=0.85, linewidth=0)


def _time_weighted(samples: Sequence[tuple[float, str, int, int]]) -> float:
    """sum over servers and sample intervals of dt * used / sum of dt * total."""
    by_server: dict[str, list[tuple[float, int, int]]] = {}
    for t, s, used, total in samples:
        by_server.setdefault(s, []).append((t, used, total))
    num = den = 0.0
    for pts in by_server.values():
        for (t0, u, tot), (t1, _, _) in zip(pts, pts[1:]):
            num += (t1 - t0) * u
            den += (t1 - t0) * tot
    return num / den if den else 0.0


def _figure(size):
    # An Agg canvas of our own: never switches pyplot's global backend (inline notebook plots keep working).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def plot_curves(path: str, curves: dict[str, Sequence[tuple[float, float]]], xlabel: str, ylabel: str) -> str:
    fig, ax = _figure((7, 4))
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name, marker=".")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
