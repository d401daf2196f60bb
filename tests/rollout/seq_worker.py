"""Subprocess side of the cross-process move test.

Builds the same tiny model/server, reads the run key (hex) from stdin, listens on 127.0.0.1 (port
printed on stdout), receives one SequenceState over the authenticated transfer
(laminar_jax.rollout.transfer), continues it to the end, and answers with a JSON-able record.
"""

import sys

from laminar_jax.rollout.transfer import SequenceListener
from tests.rollout.rollout_helpers import make_server, run_until


def main() -> None:
    key = bytes.fromhex(sys.stdin.readline().strip())
    server = make_server()
    with SequenceListener(key=key) as listener:
        print(listener.address.rsplit(":", 1)[1], flush=True)
        seq, answer = listener.accept(timeout_s=120)
        server.import_sequence(seq)
        t = run_until(server, 1)[seq.uid]
        answer({"uid": t.uid, "tokens": t.response_ids.tolist(),
                "logprobs": [float(x) for x in t.behaviour_logprobs], "version": t.version,
                "finish_reason": t.finish_reason, "moves": t.extra["moves"], "refused": listener.rejected})


if __name__ == "__main__":
    sys.exit(main())
