"""The engine-core process: the step loop in a process of its own (ENGINE.md §8).

The serving layer (`engine.client.EngineClient`) spawns it and talks to it over one pipe, one
message each way per step at most: the adds and aborts that arrived since the last step come
in, the step's `StepOutputs` go out. So nothing in the Triton stub (response sends, metrics,
cancellation polls, detokenization) can hold a step back, and the loop runs as in a benchmark.

The process is rank 0: with one rank it loads the model itself (CPU, or the GPU in its spec);
with several it coordinates them as worker processes of its own (`engine.workers`). It exits on
a "close" message, on EOF of its pipe (the stub is gone), and with its parent (parent-death
signal). A step that raises, or a dead worker, is reported once as ("failed", reason) before it
exits: the serving layer then ends every request with UNAVAILABLE.

Messages (pickled tuples): in ("add", [(id, Request), ...]), ("abort", [id, ...]), ("close",);
out ("ready", CoreInfo), ("error", message, traceback) at start-up, ("step", StepOutputs),
("failed", reason).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from k3backend.engine.config import EngineConfig

if TYPE_CHECKING:  # no torch at import: a GPU rank sets CUDA_VISIBLE_DEVICES first
    from k3backend.engine.plan import CacheCapacity

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often an idle loop checks its workers' health


@dataclass(frozen=True)
class CoreSpec:
    """Everything the engine-core process needs to build its executor (picklable)."""

    checkpoint: str
    cfg: EngineConfig
    dtype: str  # torch dtype name
    device: str  # "cpu" | "cuda"
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    gpus: tuple[int, ...] | None = None  # indices of the GPUs this server sees, one per rank
    gpu: str | None = None  # one rank on a GPU: its CUDA_VISIBLE_DEVICES entry (set before torch loads)
    dist_backend: str = "auto"
    startup_timeout_s: float = 3600.0
    step_timeout_s: float = 300.0
    log_prefix: str = "k3_lm"
    nodes: Any = None  # engine.nodes.NodePlan: ranks on other hosts too (None: all on this one)
    placement: str = "tp"  # "tp" | "host_ep" (engine.workers.placement_layout)


@dataclass(frozen=True)
class CoreInfo:
    """What the engine core reports once ready."""

    pid: int
    info: Any  # runner.ModelInfo
    capacity: CacheCapacity
    device: str
    workers_alive: int


class _Pipe:
    """The pipe to the stub; sends come from the loop and from the worker watch."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self._lock = conn, threading.Lock()

    def send(self, *message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # plain pickle: tensors as bytes
        with self._lock:
            self.conn.send_bytes(data)


def core_main(spec: CoreSpec, conn: Connection, parent: int) -> None:
    from k3backend.engine.workers import guard_against_orphaning

    guard_against_orphaning(parent)
    if spec.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.gpu  # before torch is imported
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s engine-core: %(message)s"))
    root = logging.getLogger("k3backend")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    pipe = _Pipe(conn)
    try:
        core, device = _build(spec)
    except BaseException as e:  # noqa: BLE001 - every start-up failure is reported, then this process exits
        pipe.send("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=12))
        return
    executor = core.executor
    pipe.send("ready", CoreInfo(os.getpid(), core.info, executor.capacity, device, executor.workers_alive))
    try:
        _serve(core, pipe)
    finally:
        executor.close(timeout=max(2.0, spec.step_timeout_s / 10))


def _build(spec: CoreSpec):
    import torch

    from k3backend.engine.core import EngineCore
    from k3backend.engine.runner import InProcessExecutor
    from k3backend.engine.workers import MultiProcessExecutor

    dtype = getattr(torch, spec.dtype)
    if spec.tensor_parallel_size == 1 and (spec.device == "cpu" or spec.gpu is not None):
        device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif _small(spec.checkpoint):
            torch.set_num_threads(1)
        executor = InProcessExecutor.load(spec.checkpoint, spec.cfg, dtype=dtype, device=device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        where = f"{device} ({name}, physical {spec.gpu})" if spec.gpu is not None else "cpu"
        log.info("%s: worker rank 0 pid %d device %s (the engine core)", spec.log_prefix, os.getpid(), where)
    else:
        executor = MultiProcessExecutor(spec.checkpoint, spec.cfg, dtype=spec.dtype,
                                        gpus=list(spec.gpus) if spec.gpus is not None else None,
                                        world_size=spec.tensor_parallel_size, ep_size=spec.expert_parallel_size,
                                        backend=spec.dist_backend, startup_timeout_s=spec.startup_timeout_s,
                                        step_timeout_s=spec.step_timeout_s, nodes=spec.nodes,
                                        placement=spec.placement)
        where = f"{spec.tensor_parallel_size} worker processes"
    return EngineCore(executor, spec.cfg), where


def _small(checkpoint: str) -> bool:
    """Toy models on a CPU: one thread beats several fighting over small ops."""
    from k3backend.checkpoint import load_config

    return load_config(checkpoint).text.hidden_size < 1024


def _serve(core, pipe: _Pipe) -> None:
    """Drain the messages that arrived, run a step if there is work, send its outputs; repeat."""
    from k3backend.engine.workers import WorkerFailure

    conn = pipe.conn
    try:
        while True:
            if conn.poll(0 if core.has_work else IDLE_POLL_S):
                while True:
                    try:
                        message = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        return  # the stub is gone
                    if message[0] == "close":
                        return
                    _apply(core, message)
                    if not conn.poll(0):
                        break
            elif not core.has_work:
                reason = core.executor.health()  # a dead worker while idle fails the engine too ([HLT-7])
                if reason is not None:
                    raise WorkerFailure(reason)
                continue
            if core.has_work:
                pipe.send("step", core.step())
    except BaseException as e:  # noqa: BLE001 - reported once; the serving layer ends every request
        if not isinstance(e, WorkerFailure):
            log.exception("engine step failed; every in-flight request gets an error")
        try:
            pipe.send("failed", str(e) if isinstance(e, WorkerFailure) else f"engine step failed: {type(e).__name__}: {e}")
        except OSError:
            pass


def _apply(core, message: tuple) -> None:
    kind, items = message
    if kind == "add":
        for rid, request in items:
            core.add(rid, request)
    elif kind == "abort":
        for rid in items:
            core.abort(rid)
    else:
        raise ValueError(f"engine core: unknown message {kind!r}")
