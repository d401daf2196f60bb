"""Start a chain of relay worker processes on this host (tests and the relay benchmark; the runtimes start theirs in-process or as Ray actors)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from laminar_jax.net.auth import RunKeys, check_keys
from laminar_jax.relay.config import RelaySection
from laminar_jax.net.wire import RemoteError, WireError, connect

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LocalChain:
    """Handles to n relay processes chained in order: relay i forwards to relays i+1, i+2, ..."""

    def __init__(self, procs: list[subprocess.Popen], addresses: list[str], cfg: RelaySection,
                 key: Optional[bytes] = None):
        """``key``: the run's link key (control connections to the workers)."""
        self.procs, self.addresses, self.cfg, self.key = procs, addresses, cfg, key

    def __len__(self) -> int:
        return len(self.procs)

    def alive(self, i: int) -> bool:
        return self.procs[i].poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL relay i (no goodbye: its peers see a dead socket)."""
        if self.alive(i):
            self.procs[i].send_signal(signal.SIGKILL)
            self.procs[i].wait(10)

    def configure(self) -> None:
        """Tell every relay its successors (all later relays, nearest first)."""
        for i, addr in enumerate(self.addresses):
            peer = connect(addr, self.cfg.connect_timeout_s, self.cfg.io_timeout_s, self.key)
            try:
                peer.request({"op": "set_successors", "addresses": self.addresses[i + 1:]}, "ok",
                             f"set_successors of relay {i}")
            finally:
                peer.close()

    def versions(self, i: int) -> dict:
        peer = connect(self.addresses[i], self.cfg.connect_timeout_s, self.cfg.io_timeout_s, self.key)
        try:
            h, _ = peer.request({"op": "versions"}, "versions", f"versions of relay {i}")
        finally:
            peer.close()
        return h

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every live relay, SIGKILL whatever has not exited after ``timeout``."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for p in self.procs:
            if p.stdout:
                p.stdout.close()

    def __enter__(self) -> "LocalChain":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_line(p: subprocess.Popen, timeout: float) -> Optional[str]:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else None


def start_local_chain(n: int, config: RelaySection = RelaySection(), startup_timeout: float = 30.0,
                      env: Optional[dict] = None, python: Sequence[str] = (sys.executable,),
                      keys: Optional[RunKeys] = None) -> LocalChain:
    """Spawn n ``laminar_jax.relay.worker`` processes (ephemeral ports), chain them, return handles.

    ``keys`` (the run's keys, without the private one) reach each worker on its stdin, never in
    argv or environment."""
    from laminar_jax.relay.worker import config_json

    if n < 1:
        raise ValueError(f"start_local_chain(n={n}): must be >= 1")
    config.validate("relay")
    keys = check_keys(keys, "start_local_chain")
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = _REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [*python, "-m", "laminar_jax.relay.worker", "--port", "0", "--config-json", config_json(config),
           "--parent-pid", str(os.getpid())] + (["--key-stdin"] if keys is not None else [])
    procs = []
    for _ in range(n):
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE if keys is not None else None,
                             text=True, env=env, cwd=_REPO)
        procs.append(p)
        if keys is not None:
            p.stdin.write(keys.link.hex() + "\n" + keys.public.hex() + "\n")
            p.stdin.close()
    chain = LocalChain(procs, [], config, keys and keys.link)
    try:
        deadline = time.monotonic() + startup_timeout
        for i, p in enumerate(procs):
            line = _read_line(p, max(0.1, deadline - time.monotonic()))
            if not line:
                raise TimeoutError(f"start_local_chain: relay {i} (pid {p.pid}) printed no address within "
                                   f"{startup_timeout}s (exit status {p.poll()})")
            chain.addresses.append(json.loads(line)["address"])
        chain.configure()
    except (OSError, ValueError, TimeoutError, WireError, RemoteError):
        chain.stop(2.0)
        raise
    return chain
