"""A router's side of KV events for tests: a ZMQ SUB socket on loopback decoding every batch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import zmq


class Subscriber:
    """A ZMQ SUB socket decoding every batch in a thread. It binds (loopback only) and the
    engine's publisher connects: vLLM and SGLang bind only a wildcard (``tcp://*:port``, every
    interface) or ipc endpoint, and connect to a ``tcp://host:port`` one.

    ``events_of(payload)``: the events of one batch's msgpack payload. The default endpoint
    lets the OS pick a free loopback port as it binds (no window in which another process can
    take it); :attr:`endpoint` is the one bound, for the engine's ``--kv-events-config``."""

    def __init__(self, events_of: Callable[[bytes], list[Any]], endpoint: str = "tcp://127.0.0.1:*"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.bind(endpoint)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events_of = events_of
        self.events: list[Any] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                parts = self.sock.recv_multipart()  # topic, sequence number, payload
            except zmq.Again:
                continue
            events = self.events_of(parts[-1])
            with self.lock:
                self.events.extend(events)

    def snapshot(self) -> list[Any]:
        with self.lock:
            return list(self.events)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()
