"""Subprocess side of the cross-process move test.

Builds the same tiny model/server, listens on 127.0.0.1 (port printed on stdout), receives one
SequenceState as length-prefixed bytes, continues it to the end, and answers with a JSON record.
"""

import json
import socket
import struct
import sys

from laminar_jax.rollout import SequenceState
from tests.rollout.rollout_helpers import make_server, run_until


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)}/{n} bytes")
        buf += chunk
    return buf


def main() -> None:
    server = make_server()
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        lsock.settimeout(120)
        print(lsock.getsockname()[1], flush=True)
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(120)
            (n,) = struct.unpack("<Q", _recv_exact(conn, 8))
            seq = SequenceState.from_bytes(_recv_exact(conn, n))
            server.import_sequence(seq)
            t = run_until(server, 1)[seq.uid]
            reply = json.dumps({"uid": t.uid, "tokens": t.response_ids.tolist(),
                                "logprobs": [float(x) for x in t.behaviour_logprobs], "version": t.version,
                                "finish_reason": t.finish_reason, "moves": t.extra["moves"]}).encode()
            conn.sendall(struct.pack("<Q", len(reply)) + reply)


if __name__ == "__main__":
    sys.exit(main())
