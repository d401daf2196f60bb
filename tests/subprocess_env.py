"""The environment of a child process a test starts: this checkout first on PYTHONPATH, the caller's
PYTHONPATH kept after it (packages installed under a PYTHONPATH directory stay importable)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
