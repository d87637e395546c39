"""A client that floods its request ring (issue 26 item 5): ``python -m hpkv.testing.flood FP``.

It attaches namespace ``FP`` (one rank, 8 KiB shards) on the configured server, prints
``flooding`` once its first call is queued, then pushes the largest lookups the mailbox
holds as fast as the ring takes them, reading answers only to keep the ring moving, until
it is killed. Tests use it to check that one client cannot starve the others.
"""

from __future__ import annotations

import sys

from hpkv.client import connect
from hpkv.config import load_config
from hpkv.protocol import wire as P
from hpkv.protocol.keys import KEY_BYTES, block_keys


def main(fingerprint: str) -> None:
    c = connect(load_config(), spawn=False, name="flooder")
    ns = c.attach_namespace(fingerprint, 1, 8192)
    n = P.MAX_KEYS_PER_CALL
    keys = block_keys(fingerprint, [str(i).encode() for i in range(n)])
    c._mbox[: n * KEY_BYTES] = memoryview(b"".join(keys))
    seq = 0
    while True:
        seq += 1
        c._req.push(P.LOOKUP, seq, ns.ns_id, n, timeout=5.0)
        if seq == 1:
            print("flooding", flush=True)
        while c._resp.try_pop() is not None:
            pass


if __name__ == "__main__":
    main(sys.argv[1])
