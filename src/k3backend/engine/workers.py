"""Worker processes: one per tensor-parallel rank, each a `ModelRunner` on its own device.

The engine talks to `MultiProcessExecutor` exactly as to the in-process one. Each step the
coordinator pickles the `StepPlan` (small: ints and the step's new sampling settings) into every
rank's pipe; every rank runs the same forward and meets the others in its collectives; rank 0
samples and sends the ids back. Image embedding rows travel once, with the plan that admits
their request.

Lifecycle (SERVING.md §8, [HLT-1], [HLT-2], [HLT-7], [HLT-9], [HLT-10]):
- workers are spawned (never forked) from a thread that lives until `close()`, because the
  parent-death signal each worker sets fires when the thread that created it exits; they are
  non-daemonic, each in its own process group, with `CUDA_VISIBLE_DEVICES` set before torch is
  imported, and they also exit on EOF of their control pipe;
- rendezvous through torch.distributed's TCP store, which the coordinator serves on a free
  loopback port (at master_addr:master_port when other hosts join, `engine.nodes`), NCCL on GPUs,
  gloo on CPUs; a failure or timeout of any rank during start-up kills every worker and raises
  one error naming the rank, its exit status and its last log lines;
- every wait of the coordinator is bounded and watches every worker: a rank that exits, closes
  its pipe, reports an error, or a step that outlasts `step_timeout_s` raises `WorkerFailure`,
  which fails the engine; `close()` stops the workers, then SIGTERMs and SIGKILLs what is left.

This module imports no torch at the top: the spawned child sets its device before the import.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from k3backend.engine.config import EngineConfig
from k3backend.engine.plan import CacheCapacity, StepPlan
from k3backend.interpreter import python_executable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 20


class WorkerFailure(RuntimeError):
    """A worker died, reported an error, or did not answer in time; the message names the rank."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build its runner (picklable)."""

    rank: int
    world_size: int
    ep_size: int
    gpu: str | None  # the rank's CUDA_VISIBLE_DEVICES entry (see `visible_gpu`), or None on CPU
    backend: str  # "nccl" | "gloo"
    store: tuple[str, int]  # the coordinator's TCP store (host, port): the process groups' rendezvous
    checkpoint: str
    dtype: str  # torch dtype name
    cfg: EngineConfig
    timeout_s: float  # collectives and start-up
    coordinator: tuple[str, int, bytes] | None = None  # a rank of another host: where to connect (engine.nodes)
    placement: str = "tp"  # see `placement_layout`
    nnodes: int = 1


PLACEMENTS = ("tp", "host_ep")


def check_placement(placement: str, world_size: int, ep_size: int, nnodes: int) -> None:
    """ValueError naming the setting that cannot work (the k3_lm load, the executor, the worker command)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if placement == "host_ep" and ep_size != nnodes:
        raise ValueError(f"placement host_ep puts one expert group on each host: expert_parallel_size {ep_size} "
                         f"must equal nnodes {nnodes}")


def placement_layout(placement: str, world_size: int, rank: int, ep_size: int, nnodes: int) -> dict[str, int]:
    """`Parallel`'s arguments for `rank`, less its process groups (docs/deployment.md, Placement).

    "tp": one TP group of all world_size ranks, expert groups of world_size / ep_size ranks in it.
    "host_ep": a TP group of the L = world_size / nnodes ranks of each host (rank // L), the same
    on every host, and expert group n on host n (moe-TP over its L ranks). With one host it is
    "tp" with expert_parallel_size 1 (`check_placement` wants ep_size == nnodes)."""
    if placement == "host_ep" and nnodes > 1:
        per = world_size // nnodes
        return {"tp_size": per, "tp_rank": rank % per, "ep_size": ep_size, "hosts": nnodes, "host": rank // per}
    return {"tp_size": world_size, "tp_rank": rank, "ep_size": ep_size}


def make_parallel(spec: WorkerSpec):
    """This rank's `Parallel`, after init_process_group. Under host_ep every rank creates every
    host's group, in host order (new_group is collective over the whole world)."""
    import torch.distributed as dist

    from k3backend.model.parallel import Parallel

    layout = placement_layout(spec.placement, spec.world_size, spec.rank, spec.ep_size, spec.nnodes)
    if layout.get("hosts", 1) == 1:
        return Parallel(**layout, group=dist.group.WORLD)
    per = layout["tp_size"]
    groups = [dist.new_group(list(range(n * per, (n + 1) * per))) for n in range(spec.nnodes)]
    return Parallel(**layout, group=groups[layout["host"]], world_group=dist.group.WORLD)


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once it is ready."""

    rank: int
    pid: int
    device: str
    weight_bytes: int
    capacity: CacheCapacity
    info: Any  # runner.ModelInfo (rank 0's is the engine's)
    prefill_ms: dict[int, dict[int, float]]  # the runner's measured prefill step times (rank 0's are the engine's)
    decode_ms: float  # and its slowest decode step's


# ---- the worker process ---------------------------------------------------------------------------

class _Tail(logging.Handler):
    """The last log lines of this rank, sent with an error report."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def guard_against_orphaning(parent: int) -> None:
    """Own process group; SIGKILL when the spawning thread's process dies ([HLT-10])."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's; the coordinator stops us


def worker_main(spec: WorkerSpec, conn: Connection | None, parent: int) -> None:
    """One rank: build the runner, report, then run every message of the pipe until "stop" or EOF.

    A rank of another host gets no pipe: it connects to the coordinator itself (`engine.nodes`),
    and the connection then works as the pipe does."""
    guard_against_orphaning(parent)
    if spec.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.gpu  # before torch is imported
    if conn is None:
        from k3backend.engine.node_agent import connect_rank

        conn = connect_rank(spec)
    tail = _Tail()
    handler = logging.StreamHandler()
    for h in (tail, handler):
        h.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s rank {spec.rank}: %(message)s"))
    root = logging.getLogger("k3backend")
    root.handlers[:] = [handler, tail]
    root.setLevel(logging.INFO)
    try:
        runner = _build(spec, conn)
    except BaseException as e:  # noqa: BLE001 - every start-up failure is reported, then this rank exits
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=8), list(tail.lines)))
        return
    _serve(runner, conn, spec, tail)


def _build(spec: WorkerSpec, conn: Connection):
    import torch
    import torch.distributed as dist

    from k3backend.checkpoint import load_model
    from k3backend.engine.runner import ModelInfo, ModelRunner, size_cache
    from k3backend.model.cache import CachePools

    device = torch.device("cuda", 0) if spec.gpu is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # CPU ranks (tests, gloo) share the host's cores
    import datetime

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.store[0], spec.store[1], None, False, timeout=timeout)
    dist.init_process_group(spec.backend, store=store, world_size=spec.world_size, rank=spec.rank, timeout=timeout)
    par = make_parallel(spec)
    model = load_model(spec.checkpoint, dtype=getattr(torch, spec.dtype), device=device, progress=False, par=par,
                       vision=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cap = size_cache(model, spec.cfg)
    sizes = torch.tensor([cap.num_blocks, cap.num_slots], device=device if spec.backend == "nccl" else "cpu")
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN)  # every rank schedules against the same pools
    cap = CacheCapacity(int(sizes[0]), int(sizes[1]), cap.block_size)
    pools = CachePools.allocate(model.language_model, cap.num_slots, cap.num_blocks, cap.block_size)
    runner = ModelRunner(model, pools, samples=spec.rank == 0)
    runner.capture_graphs(spec.cfg)  # every rank captures the same sizes, meeting in the same collectives
    text = model.cfg.text
    info = ModelInfo(text.vocab_size, text.hidden_size, model.cfg.media_placeholder_token_id)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    conn.send(("ready", RankInfo(spec.rank, os.getpid(), f"{device} ({name}, physical {spec.gpu})"
                                 if spec.gpu is not None else "cpu", weight_bytes, cap, info, runner.prefill_ms,
                                 runner.decode_ms)))
    return runner


def _serve(runner, conn: Connection, spec: WorkerSpec, tail: _Tail) -> None:
    import torch.distributed as dist

    try:
        while True:
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                return  # the coordinator is gone
            if kind == "stop":
                return
            start = time.perf_counter()
            result = None if kind == "ping" else getattr(runner, kind)(payload)  # "execute" or "logits"
            if spec.rank == 0:
                if kind == "logits":
                    result = result.cpu()
                conn.send(("ok", result, time.perf_counter() - start))
    except BaseException as e:  # noqa: BLE001
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=8), list(tail.lines)))
        except OSError:
            pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


# ---- spawning ------------------------------------------------------------------------------------

class Spawner:
    """Starts child processes ("spawn", never fork) from one thread that lives until `close()`.

    A child arms PR_SET_PDEATHSIG (`guard_against_orphaning`), which fires when the *thread* that
    created it exits, not its process: so the creating thread must outlive the children.
    """

    def __init__(self, name: str) -> None:
        self.ctx = mp.get_context("spawn")
        self.ctx.set_executable(python_executable())
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def spawn(self, target: Any, args: tuple, name: str) -> Any:
        """Start `target(*args, parent_pid)` in a new process; returns the started Process."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((target, args, name, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            target, args, name, done = job
            try:
                p = self.ctx.Process(target=target, args=(*args, os.getpid()), name=name, daemon=False)
                p.start()
                done.put(p)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.put(e)


# ---- the coordinator ------------------------------------------------------------------------------

POLL_S = 0.5  # how often a wait of the coordinator also reads the other hosts' agents (engine.nodes)


def stop_processes(procs: list, timeout: float) -> None:
    """Join `procs` up to `timeout`; then SIGTERM each one's process group, SIGKILL 2 s later ([HLT-9])."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in alive:
            p.join(grace)


def resolve_backend(backend: str, on_gpus: bool) -> str:
    """`auto`: NCCL between GPUs, gloo between CPUs."""
    return ("nccl" if on_gpus else "gloo") if backend == "auto" else backend


def visible_gpu(index: int) -> str:
    """The device a rank gets for GPU `index` among those this process sees: an entry of our own
    CUDA_VISIBLE_DEVICES (an ordinal or a UUID) when it is set, else the ordinal itself."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(index)
    if index >= len(visible):
        raise ValueError(f"GPU {index} is not among the {len(visible)} of CUDA_VISIBLE_DEVICES={','.join(visible)}")
    return visible[index]


class MultiProcessExecutor:
    """Ranks 0..world-1 as worker processes; the engine's `Executor` (see module docstring).

    With `nodes.nnodes` > 1 this host runs the first block of ranks and the others join from their
    hosts (`engine.nodes`); a remote rank is then a connection and a `RemoteRank`, where a local
    one is a pipe and a `Process`, and everything below treats both alike."""

    def __init__(self, checkpoint: str, cfg: EngineConfig, *, dtype: str, gpus: list[int] | None, world_size: int,
                 ep_size: int = 1, backend: str = "auto", startup_timeout_s: float = 3600.0,
                 step_timeout_s: float = 300.0, nodes: Any = None, placement: str = "tp") -> None:
        from k3backend.engine.nodes import NodePlan, Rendezvous, describe

        plan = nodes or NodePlan()
        check_placement(placement, world_size, ep_size, plan.nnodes)
        local = plan.ranks_of(0, world_size)
        if gpus is not None and len(gpus) != len(local):
            raise ValueError(f"{len(local)} ranks on this host need {len(local)} GPUs, got gpu ids {gpus}")
        backend = resolve_backend(backend, gpus is not None)
        self.world_size, self.step_timeout_s = world_size, step_timeout_s
        template = WorkerSpec(-1, world_size, ep_size, None, backend, ("", 0), "", dtype, cfg,
                              max(startup_timeout_s, step_timeout_s), placement=placement, nnodes=plan.nnodes)
        devices = [None] * len(local) if gpus is None else [visible_gpu(g) for g in gpus]
        job = (describe(checkpoint, world_size, ep_size, plan.nnodes, dtype, backend, placement)
               if plan.nnodes > 1 else None)
        self._rdv = Rendezvous(plan, world_size, template, job)  # unique per k3_lm instance
        self._specs = [replace(template, rank=r, gpu=devices[r], checkpoint=str(checkpoint), store=self._rdv.address)
                       for r in local]
        self._spawner = Spawner("k3-workers")
        self._procs: list[Any] = [None] * world_size  # Process here, nodes.RemoteRank on another host
        self._conns: list[Connection | None] = [None] * world_size
        self._lock = threading.Lock()  # one call at a time over the pipes
        self._failure: str | None = None
        self.coordination_s = 0.0  # time in execute() not spent computing on rank 0 (plan out, ids back)
        try:
            for spec in self._specs:
                parent, child = self._spawner.ctx.Pipe()
                self._procs[spec.rank] = self._spawner.spawn(worker_main, (spec, child), f"k3-rank{spec.rank}")
                child.close()
                self._conns[spec.rank] = parent
            self.ranks = self._await_ready(startup_timeout_s)
        except BaseException:
            self.close(timeout=2.0)
            raise
        self.info = self.ranks[0].info
        self.capacity, self.prefill_ms, self.decode_ms = (self.ranks[0].capacity, self.ranks[0].prefill_ms,
                                                          self.ranks[0].decode_ms)
        from k3backend.engine.runner import log_capacity  # here: this module must not import torch (see _main)

        log_capacity(self.capacity, cfg)
        for r in self.ranks:
            log.info("k3_lm: worker rank %d pid %d device %s%s", r.rank, r.pid, r.device,
                     getattr(self._procs[r.rank], "where", ""))  # [HLT-1]
            log.info("worker rank %d: %.2f GiB of weights", r.rank, r.weight_bytes / 2**30)

    # ---- start-up ----------------------------------------------------------------------------

    def _await_ready(self, timeout_s: float) -> list[RankInfo]:
        ready: dict[int, RankInfo] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(self.world_size) if r not in ready]
                raise WorkerFailure(f"worker ranks {missing} did not start within startup_timeout_s {timeout_s:g}")
            self._rdv.admit(self._conns, self._procs)
            for rank, msg in self._wait_any(left):
                if msg[0] == "ready":
                    ready[rank] = msg[1]
        return [ready[r] for r in range(self.world_size)]

    def _wait_any(self, timeout_s: float) -> list[tuple[int, tuple]]:
        """Messages of ranks that sent one; raises WorkerFailure for an error, an exit, EOF or a lost host.
        Returns within POLL_S (empty when nothing came) to keep reading the other hosts' agents."""
        objs = {c: r for r, c in enumerate(self._conns) if c is not None}
        objs |= {p.sentinel: r for r, p in enumerate(self._procs) if p is not None and p.sentinel is not None}
        out = []
        for obj in wait(list(objs) + [n.conn for n in self._rdv.nodes], min(timeout_s, POLL_S)):
            rank = objs.get(obj)
            if rank is None:
                continue  # a node agent's message: read by _check_nodes below
            if isinstance(obj, Connection):
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    raise WorkerFailure(self._death(rank, "closed its pipe")) from None
                if msg[0] == "error":
                    dead = self._dead_peer(rank)
                    if dead is not None:  # its collective failed because a peer died: name the cause
                        raise WorkerFailure(self._death(dead, "exited"))
                    _, err, tb, lines = msg
                    where = getattr(self._procs[rank], "where", "")
                    raise WorkerFailure(f"worker rank {rank}{where} failed: {err}\n--- its last log lines ---\n"
                                        + "\n".join(lines) + f"\n--- traceback ---\n{tb}")
                out.append((rank, msg))
            else:
                raise WorkerFailure(self._death(rank, "exited"))
        self._check_nodes()
        return out

    def _check_nodes(self) -> None:
        dead = self._rdv.check()
        if dead is not None:
            raise WorkerFailure(self._death(dead, "exited"))

    def _dead_peer(self, rank: int, grace_s: float = 0.5) -> int | None:
        """A rank other than `rank` that died (waiting up to `grace_s` for its exit to show)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [r for r, p in enumerate(self._procs) if r != rank and p is not None and not p.is_alive()]
            if dead or time.monotonic() > deadline:
                return dead[0] if dead else None
            time.sleep(0.02)

    def _death(self, rank: int, what: str) -> str:
        p = self._procs[rank]
        p.join(0.5)
        code = p.exitcode
        how = "still running" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"
        if code is None and getattr(p, "node", None) is not None and p.node.lost is not None:
            how = f"its host's worker agent {p.node.lost}"
        return f"worker rank {rank} pid {p.pid}{getattr(p, 'where', '')} {what} ({how})"

    # ---- the Executor interface ----------------------------------------------------------------

    overlap = False  # the ranks take no PENDING inputs (that needs the drawn ids on every rank): the
    # engine waits for each step's ids before it schedules the next

    def launch(self, plan: StepPlan):
        return self._call("execute", plan)  # each rank's runner.execute: the step, waited for

    def finish(self, launched):
        return launched

    def logits(self, plan: StepPlan):
        """Rank 0's logits of a plan (tests: parity of the parallel layers)."""
        return self._call("logits", plan)

    def ping(self) -> float:
        """Seconds of one empty round trip to every rank and back from rank 0: the coordination floor."""
        start = time.perf_counter()
        self._call("ping", StepPlan())
        return time.perf_counter() - start

    def _call(self, kind: str, plan: StepPlan):
        with self._lock:
            if self._failure is not None:
                raise WorkerFailure(self._failure)
            start = time.perf_counter()
            message = pickle.dumps((kind, _host_plan(plan)), protocol=pickle.HIGHEST_PROTOCOL)  # once for all ranks
            try:
                for conn in self._conns:
                    conn.send_bytes(message)
                deadline = time.monotonic() + self.step_timeout_s
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise WorkerFailure(f"worker rank 0 did not finish a step within step_timeout_s "
                                            f"{self.step_timeout_s:g}")
                    for rank, msg in self._wait_any(left):
                        if rank == 0 and msg[0] == "ok":
                            self.coordination_s += time.perf_counter() - start - msg[2]
                            return msg[1]
            except (WorkerFailure, OSError) as e:
                self._failure = str(e)
                raise WorkerFailure(str(e)) from None

    def health(self) -> str | None:
        """Why the workers cannot serve, or None ([HLT-7]: a dead rank fails the engine while it idles).
        Called while the engine idles, it also keeps the other hosts' heartbeats answered."""
        if self._failure is None:
            try:
                self._check_nodes()
            except WorkerFailure as e:
                self._failure = str(e)
        if self._failure is None:
            for rank, p in enumerate(self._procs):
                if not p.is_alive():
                    self._failure = self._death(rank, "exited")
                    break
        return self._failure

    @property
    def workers_alive(self) -> int:
        return sum(p is not None and p.is_alive() for p in self._procs)

    def close(self, timeout: float = 20.0) -> None:
        """Stop message, join; then SIGTERM each local worker's group, SIGKILL 2 s later ([HLT-9]);
        the other hosts' agents stop theirs."""
        for conn in self._conns:
            try:
                if conn is not None:
                    conn.send_bytes(pickle.dumps(("stop", None)))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        self._rdv.stop()
        stop_processes([p for p in self._procs if p is not None and p.sentinel is not None], timeout)
        self._rdv.close(max(1.0, deadline - time.monotonic()))
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._spawner.close()


def _host_plan(plan: StepPlan) -> StepPlan:
    """Image rows go to the ranks as CPU tensors (each rank moves them to its device)."""
    if not any(r.image_embeds is not None and r.image_embeds.device.type != "cpu" for r in plan.new):
        return plan
    new = [r if r.image_embeds is None else replace(r, image_embeds=r.image_embeds.cpu()) for r in plan.new]
    return replace(plan, new=new)
