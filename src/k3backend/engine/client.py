"""The serving layer's end of the engine-core process (ENGINE.md §8, SERVING.md §8.3).

`EngineClient` starts the process, hands it requests and aborts, and reads its per-step messages.
Every send goes through one sender thread, so no caller ever blocks on the pipe: the thread that
reads the engine's outputs must never wait for the engine to read (each would wait for the other).
Adds and aborts queued while the engine was busy travel together in one message.

A dead engine core shows as EOF on the pipe, at once; `failure` then says why.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from k3backend.engine.core_process import CoreInfo, CoreSpec, core_main
from k3backend.engine.request import Request
from k3backend.engine.workers import Spawner

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine core could not start; the message carries its error and traceback."""


class EngineClient:
    """Owns the engine-core process; `close()` is idempotent."""

    def __init__(self, spec: CoreSpec) -> None:
        self._spawner = Spawner("k3-engine-core-spawner")
        parent, child = self._spawner.ctx.Pipe()
        self.process = self._spawner.spawn(core_main, (spec, child), "k3-engine-core")
        child.close()
        self.conn: Connection = parent
        self.failure: str | None = None  # why the engine core can no longer serve
        self._reported = False  # the failure was returned by receive()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._closed = False
        try:
            self.ready: CoreInfo = self._await_ready(spec.startup_timeout_s)
        except BaseException:
            self._kill()
            raise
        self.info, self.capacity = self.ready.info, self.ready.capacity
        self._sender = threading.Thread(target=self._send_loop, name="k3-engine-send", daemon=True)
        self._sender.start()

    # ---- requests -----------------------------------------------------------------------------

    def add(self, request: Request) -> int:
        """Queue `request` for the engine; returns the id its outputs carry."""
        rid = next(self._ids)
        self._outbox.put(("add", rid, request))
        return rid

    def abort(self, rid: int) -> None:
        self._outbox.put(("abort", rid, None))

    # ---- the engine's messages ------------------------------------------------------------------

    def fileno(self) -> int:
        """The pipe's descriptor, for `multiprocessing.connection.wait` beside other sources."""
        return self.conn.fileno()

    def receive(self) -> list[tuple]:
        """Every message that has arrived, without waiting: ("step", StepOutputs) items, then, once,
        ("failed", reason) when the engine core failed, died or was killed; nothing after that."""
        if self._reported:
            return []
        messages: list[tuple] = []
        try:
            while self.failure is None and self.conn.poll(0):
                message = pickle.loads(self.conn.recv_bytes())
                if message[0] == "failed":
                    self.failure = message[1]
                else:
                    messages.append(message)
        except (EOFError, OSError):
            self.failure = self.failure or self._death()
        if self.failure is not None:
            self._reported = True
            messages.append(("failed", self.failure))
        return messages

    @property
    def readable(self) -> bool:
        """Whether `receive()` can still return anything (wait on the pipe only while it can)."""
        return not self._reported

    def kill(self, reason: str) -> None:
        """End the engine core now (a stuck step): its pipe's EOF then reports `reason`."""
        self.failure = self.failure or reason
        self._kill()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self, timeout: float = 20.0, reader_gone: Callable[[], bool] = lambda: True) -> None:
        """Ask the engine core to finish, wait up to `timeout`, then kill it. Meanwhile what it still
        sends is read and dropped (a core blocked on a full pipe never reads "close"), from when
        `reader_gone()` says no other thread reads its messages any more."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(("close", 0, None))
        self._outbox.put(None)
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and (left := deadline - time.monotonic()) > 0:
            if not reader_gone():
                self.process.join(min(left, 0.1))
            elif self.conn in wait([self.conn, self.process.sentinel], left):
                try:
                    self.conn.recv_bytes()
                except (EOFError, OSError):
                    break
        self.process.join(max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():
            log.error("engine core pid %d did not exit within %.1f s; killing it", self.process.pid, timeout)
        self._kill()
        self.conn.close()
        self._spawner.close()

    # ---- internals ----------------------------------------------------------------------------

    def _await_ready(self, timeout_s: float) -> CoreInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartError(f"the engine core did not start within startup_timeout_s {timeout_s:g}")
            ready = wait([self.conn, self.process.sentinel], left)
            if self.conn in ready:
                try:
                    message = pickle.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    raise EngineStartError(f"{self._death()} during start-up") from None
                if message[0] == "error":
                    raise EngineStartError(f"the engine core failed to start: {message[1]}\n{message[2]}")
                return message[1]
            if self.process.sentinel in ready:
                raise EngineStartError(f"{self._death()} during start-up")

    def _send_loop(self) -> None:
        """One message per kind for everything queued meanwhile, adds before aborts (an abort of a
        request in the same batch finds it)."""
        while (item := self._outbox.get()) is not None:
            batch = [item]
            while True:
                try:
                    nxt = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._outbox.put(None)
                    break
                batch.append(nxt)
            adds = [(rid, req) for kind, rid, req in batch if kind == "add"]
            aborts = [rid for kind, rid, _ in batch if kind == "abort"]
            messages = [m for m in (("add", adds), ("abort", aborts)) if m[1]]
            messages += [("close",)] if any(kind == "close" for kind, _, _ in batch) else []
            try:
                for m in messages:
                    self.conn.send_bytes(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                return  # the engine core is gone: the reader reports it

    def _death(self) -> str:
        self.process.join(0.5)
        code = self.process.exitcode
        how = "still running" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"
        return f"engine core process pid {self.process.pid} exited ({how})"

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
