"""Per-server slot-occupancy timeline, coloured by weight version, with publishes marked."""

from __future__ import annotations

import threading
from typing import Sequence


class Timeline:
    """Samples of (t, server, slots_used, version) plus publish events; thread-safe."""

    def __init__(self, t0: float):
        self.t0 = t0
        self._lock = threading.Lock()
        self.samples: list[tuple[float, str, int, int, int]] = []  # t, server, used, total, version
        self.publishes: list[tuple[float, int]] = []

    def sample(self, t: float, server: str, used: int, total: int, version: int) -> None:
        with self._lock:
            self.samples.append((t - self.t0, server, used, total, version))

    def publish(self, t: float, version: int) -> None:
        with self._lock:
            self.publishes.append((t - self.t0, version))

    def slot_utilization(self) -> float:
        """Time-weighted mean of used/total slots over all servers."""
        with self._lock:
            by_server: dict[str, list[tuple[float, int, int]]] = {}
            for t, s, used, total, _ in self.samples:
                by_server.setdefault(s, []).append((t, used, total))
        num = den = 0.0
        for pts in by_server.values():
            for (t0, u, tot), (t1, _, _) in zip(pts, pts[1:]):
                num += (t1 - t0) * u
                den += (t1 - t0) * tot
        return num / den if den else 0.0

    def render(self, path: str, title: str = "") -> str:
        import matplotlib
        import matplotlib.patches

        with self._lock:
            samples, publishes = list(self.samples), list(self.publishes)
        servers = sorted({s for _, s, *_ in samples})
        versions = sorted({v for *_, v in samples}) or [0]
        cmap = matplotlib.colormaps["viridis"].resampled(max(2, len(versions)))
        color = {v: cmap(i) for i, v in enumerate(versions)}
        fig, ax = _figure((10, 1.0 + 0.8 * len(servers)))
        for row, server in enumerate(servers):
            pts = [(t, u, tot, v) for t, s, u, tot, v in samples if s == server]
            for (t0, u, tot, v), (t1, *_rest) in zip(pts, pts[1:]):
                if u:
                    ax.broken_barh([(t0, t1 - t0)], (row, 0.9 * u / max(tot, 1)), color=color[v], linewidth=0)
        for t, v in publishes:
            ax.axvline(t, color="red", linewidth=0.6, alpha=0.6)
        ax.set_yticks([i + 0.45 for i in range(len(servers))], servers)
        ax.set_xlabel("seconds (bar height = slot occupancy; colour = weight version; red = publish)")
        ax.set_title(title or "rollout slot occupancy")
        handles = [matplotlib.patches.Rectangle((0, 0), 1, 1, color=color[v]) for v in versions[-8:]]
        ax.legend(handles, [f"v{v}" for v in versions[-8:]], loc="upper right", fontsize=7, ncol=4)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


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
