"""The server logs under its lock: a stderr that nobody reads must never stall it."""

from __future__ import annotations

import logging
import os
import threading

from hpkv.runtime.logs import FORMAT, StderrHandler


def test_a_stderr_pipe_nobody_reads_drops_lines_instead_of_blocking_then_says_so():
    r, w = os.pipe()
    log = logging.getLogger("hpkv.test-stderr")
    log.propagate = False
    h = StderrHandler(fd=w)
    h.setFormatter(logging.Formatter(FORMAT))
    log.addHandler(h)
    try:
        line = "x" * 200
        writer = threading.Thread(
            target=lambda: [log.warning("%d %s", i, line) for i in range(5000)], daemon=True
        )
        writer.start()
        writer.join(30)
        assert not writer.is_alive(), "logging blocked on a full stderr pipe"
        assert h.dropped > 0, "1 MB of lines into a 64 KiB pipe: some were dropped"
        os.set_blocking(r, False)
        got = b""
        while True:
            try:
                chunk = os.read(r, 1 << 16)
            except BlockingIOError:
                break
            got += chunk
        assert got.startswith(b"20") and b" 0 " + line.encode() in got.splitlines()[0]
        assert all(ln.endswith(line.encode()) for ln in got.splitlines()), "whole lines only"
        dropped = h.dropped
        log.warning("after")
        notice, after = os.read(r, 1 << 16).decode().splitlines()
        assert (
            notice
            == f"hpkv: {dropped} log line(s) not written to stderr (nobody read it); server.log has them"
        )
        assert after.endswith("after") and h.dropped == 0
    finally:
        log.removeHandler(h)
        os.close(r)
        os.close(w)
