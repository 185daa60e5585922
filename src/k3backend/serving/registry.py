"""Every `k3_lm` request in flight, by client id and engine id, and the stop tombstones (SERVING.md §6).

One lock guards the streams, the tombstones and the admission rules, so a stop finds its target
whatever it is doing (being prepared, queued in the engine, running: [CAN-5]) and a tombstone is
consumed exactly once ([CAN-7]). Tombstones are bounded: 16 bytes per remembered id, at most
`MAX_TOMBSTONES`, expired oldest first (the TTL is one constant, so expiry order is insertion order).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time

from k3backend.errors import Unavailable
from k3backend.serving.stream import Cancel, RequestStream

SHUTDOWN_ERROR = "server shutting down"
MAX_TOMBSTONES = 65536  # unmatched stop ids remembered at once; the oldest go first beyond it


def _digest(client_id: str) -> bytes:
    """16 bytes per remembered stop id, however long the id (ids are client-chosen)."""
    return hashlib.blake2b(client_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Registry:
    """The requests between `execute()` and their final response; see the module docstring."""

    def __init__(self, tombstone_ttl_s: float, max_queued: int = 0) -> None:
        self.lock = threading.Lock()
        self.tombstone_ttl_s, self.max_queued = tombstone_ttl_s, max_queued
        self._by_client: dict[str, list[RequestStream]] = {}
        self._by_rid: dict[int, RequestStream] = {}
        self._tombstones: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._count = 0
        self.closing = False  # close() began: new requests are refused
        self.failure: str | None = None  # the engine failed: new requests are refused

    def __len__(self) -> int:
        with self.lock:
            return self._count

    def open(self, stream: RequestStream) -> bool:
        """Register a new request; False when a live tombstone of its id cancels it at once ([CAN-7]).
        Raises Unavailable when closing, failed, or the queue is full (max_queued_requests)."""
        with self.lock:
            if self.closing:
                raise Unavailable(SHUTDOWN_ERROR)
            if self.failure is not None:
                raise Unavailable(f"engine is not healthy (engine failed: {self.failure})")
            if self.max_queued:
                waiting = sum(not s.started for same in self._by_client.values() for s in same)
                if waiting >= self.max_queued:
                    raise Unavailable(f"request queue is full ({waiting} waiting, max_queued_requests "
                                      f"{self.max_queued})")
            if self._take_tombstone(stream.client_id):
                return False
            self._by_client.setdefault(stream.client_id, []).append(stream)
            self._count += 1
            return True

    def stop(self, client_id: str) -> list[RequestStream]:
        """[CAN-5]: mark every request in flight with this id STOP and return those the engine runs
        (the caller aborts them there); with none, leave a tombstone ([CAN-7])."""
        with self.lock:
            streams = [s for s in self._by_client.get(client_id, []) if not s.done]
            for s in streams:
                s.cancel = s.cancel or Cancel.STOP
            if not streams and self.tombstone_ttl_s > 0:
                key = _digest(client_id)
                self._tombstones[key] = time.monotonic() + self.tombstone_ttl_s
                self._tombstones.move_to_end(key)
                while len(self._tombstones) > MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)
            return [s for s in streams if s.rid]

    def bind(self, stream: RequestStream, rid: int) -> None:
        """Under `lock`: the stream runs in the engine as `rid` (the caller checked `cancel` first)."""
        stream.rid = rid
        self._by_rid[rid] = stream

    def by_rid(self, rid: int) -> RequestStream | None:
        return self._by_rid.get(rid)

    def forget(self, stream: RequestStream) -> None:
        """The stream's final response was sent: stops no longer match it."""
        with self.lock:
            same = self._by_client.get(stream.client_id, [])
            if stream in same:
                same.remove(stream)
                self._count -= 1
            if not same:
                self._by_client.pop(stream.client_id, None)
            if stream.rid:
                self._by_rid.pop(stream.rid, None)

    def num_preparing(self) -> int:
        """Requests not yet handed to the engine (being tokenized)."""
        with self.lock:
            return sum(not s.rid for same in self._by_client.values() for s in same)

    def engine_in_flight(self) -> int:
        with self.lock:
            return sum(not s.done for s in self._by_rid.values())

    def _take_tombstone(self, client_id: str) -> bool:
        """Under the lock: consume a live tombstone of this id, dropping the expired ones first."""
        if not self._tombstones:
            return False
        now = time.monotonic()
        while self._tombstones and next(iter(self._tombstones.values())) < now:
            self._tombstones.popitem(last=False)
        return self._tombstones.pop(_digest(client_id), None) is not None
