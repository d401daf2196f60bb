"""Relay worker process: ``python -m laminar_jax.relay.worker [--port P] [--config-json J] [--successors a,b]
[--parent-pid P] [--key-stdin | --key-file F [--public-key-file P]]``.

With ``--key-stdin`` the run's link key and the learner's public key (hex) are stdin's first two
lines; with ``--key-file`` the link key is read from an owner-only key file (auth.run_key) and the
public key from ``--public-key-file`` (default: ``learner.pub`` beside the key file). Keys never
appear in argv; a relay never gets the learner's private key.

Prints one JSON line ``{"address": "host:port", "pid": ...}`` on stdout once listening, then
serves until SIGTERM/SIGINT or a ``stop`` request. A background failure is printed to stderr
and ends the process with status 1. With ``--parent-pid`` it also exits (within ~0.2 s) once
that process stops being its parent, so a crashed or OOM-killed owner leaves no relay behind.
Imports no jax (fast start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Optional

from laminar_jax.configlib import from_config_dict
from laminar_jax.net.auth import RunKeys
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.server import RelayServer


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="laminar_jax.relay.worker", description=__doc__)
    p.add_argument("--port", type=int, default=None, help="TCP port (default: config base_port; 0 = ephemeral)")
    p.add_argument("--config-json", default="{}", help="RelaySection fields as a JSON object")
    p.add_argument("--successors", default="", help="comma-separated host:port of the next relays, nearest first")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is no longer our parent (it died: no orphaned relays)")
    p.add_argument("--key-stdin", action="store_true",
                   help="read the run's link key and the learner's public key (hex) from stdin's first two lines")
    p.add_argument("--key-file", default=None, help="read the run's link key from this owner-only file")
    p.add_argument("--public-key-file", default=None,
                   help="the learner's public key (default with --key-file: learner.pub beside it)")
    return p.parse_args(argv)


def read_keys(args: argparse.Namespace) -> Optional[RunKeys]:
    from laminar_jax.net.auth import LEARNER_PUB_FILE, load_key, load_public_key

    if args.key_file:
        pub = args.public_key_file or os.path.join(os.path.dirname(os.path.abspath(args.key_file)), LEARNER_PUB_FILE)
        return RunKeys(load_key(args.key_file), load_public_key(pub))
    if not args.key_stdin:
        return None
    lines = [sys.stdin.readline().strip() for _ in range(2)]
    try:
        return RunKeys(bytes.fromhex(lines[0]), bytes.fromhex(lines[1]))
    except ValueError:
        raise SystemExit("relay worker: --key-stdin: stdin's first two lines must be the link key and the "
                         "learner's public key, as hex") from None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = from_config_dict(RelaySection, json.loads(args.config_json), "relay")
    successors = [a for a in args.successors.split(",") if a]
    server = RelayServer(cfg, successors=successors, port=args.port, keys=read_keys(args)).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(json.dumps({"address": server.address, "pid": os.getpid(),
                      "relay_id": server.relay_id}), flush=True)
    try:
        while not done.wait(0.2) and not server.stopped:
            server.check()
            if args.parent_pid is not None and os.getppid() != args.parent_pid:
                print(f"relay worker {server.address}: parent {args.parent_pid} is gone; exiting",
                      file=sys.stderr, flush=True)
                break
    except RuntimeError as e:
        print(f"relay worker {server.address}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop()
    return 0


def config_json(cfg: RelaySection) -> str:
    """The --config-json argument for ``cfg``."""
    return json.dumps(dataclasses.asdict(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
