"""The threads that send `k3_lm`'s responses, so that round trips of different requests overlap.

A `sender.send()` is a round trip to the server: the Python backend posts it to the server's
thread pool and waits for the answer, with the GIL released. One thread sending every response
caps the responses per second at one over that round trip, and the last request of a step waits
for all the others (at 64 streams, tens of milliseconds). A request's responses all go through
one thread, in the order they were put, so no two threads ever touch one sender.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class SendPool:
    """`threads` send threads; `put(shard, ...)` queues a send on thread `shard % threads`, and
    `sent(key)` is called on that thread once the send returned (or failed)."""

    def __init__(self, threads: int, sent: Callable[[Any], None], name: str = "k3-lm-send") -> None:
        self._sent = sent
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def __len__(self) -> int:
        return len(self._queues)

    def put(self, shard: int, sender: Any, response: Any, flags: int, client_id: str, key: Any = None) -> None:
        self._queues[shard % len(self._queues)].put((sender, response, flags, client_id, key))

    def close(self, timeout: float) -> None:
        """Send what is queued, then end the threads (waiting up to `timeout` s in all)."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            sender, response, flags, client_id, key = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001 - a vanished client must not stop other responses
                log.exception("sending a response of request %r failed", client_id)
            if key is not None:
                self._sent(key)
