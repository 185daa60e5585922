"""Ranks on other hosts (`nnodes` > 1): the rendezvous, the node agent, and how the coordinator sees them.

Placement (docs/deployment.md): the tensor_parallel_size ranks form nnodes blocks of consecutive
ranks; node n holds ranks [n·L, (n+1)·L), L = T / nnodes, and node 0 is the Triton host. A rank's
expert group is rank // (T / E), so with E a multiple of nnodes no expert group spans two hosts.
Placement "tp" makes all T ranks one TP group; "host_ep" makes each host's L ranks a TP group,
replicated across hosts, with expert group n on node n (`workers.placement_layout`).

Rendezvous, in torch.distributed's TCP store, which the Triton host's engine core serves at
master_addr:master_port (the process groups meet in the same store):
1. the coordinator puts its listener's port and key under `k3/coordinator`;
2. a node agent (`python -m k3backend worker`, `engine.node_agent`) connects and sends ("join",
   node_rank, JobDescription, pid, hostname); the coordinator compares the job with its own and
   answers ("refused", why), naming every difference, logged on both sides, or ("welcome",
   template WorkerSpec, ranks);
3. the agent spawns its ranks with `workers.worker_main`, the code of the local ranks; each
   connects to the coordinator and says ("hello", rank, pid). From then on a remote rank is one
   connection, as a local rank is one pipe: the same plans out, rank 0's ids back.

Liveness: the agent reports each rank's exit ("died", rank, exitcode) and sends ("alive",) every
HEARTBEAT_S, which the coordinator answers whenever it reads (at least every HEARTBEAT_S while it
waits on a step or idles). A killed process shows at once as EOF; a side that hears nothing for
SILENCE_S (a host lost, a network cut) gives the other up: the coordinator fails the engine,
naming the node, and the agent stops its ranks and exits.

The key handed out through the store only keeps strays out: like torch.distributed itself, this
assumes a trusted cluster network.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, fields
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path

from k3backend.engine.workers import WorkerFailure, WorkerSpec

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
SILENCE_S = 5.0
STORE_KEY = "k3/coordinator"
SAMPLE_BYTES = 1 << 20  # of each weight file's data, in the fingerprint


@dataclass(frozen=True)
class NodePlan:
    """Where the ranks run: `nnodes` hosts meeting at master_addr:master_port (0: a free port, one host)."""

    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    dist_timeout_s: float = 300.0  # how long each side waits for the other at the rendezvous

    def check(self, world_size: int, node_rank: int) -> None:
        """ValueError naming the setting that cannot work (both the k3_lm load and the worker command)."""
        if self.nnodes < 1 or world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {world_size} is not divisible by nnodes {self.nnodes} "
                             "(every host runs the same number of ranks)")
        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"node_rank {node_rank} is not in [0, {self.nnodes - 1}] (nnodes {self.nnodes})")
        if self.nnodes > 1 and not (self.master_addr and 0 < self.master_port < 65536):
            raise ValueError(f"nnodes {self.nnodes} needs master_addr (the Triton host's address that the "
                             f"other hosts reach) and a master_port in [1, 65535], got "
                             f"{self.master_addr!r}:{self.master_port}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s:g}")

    def ranks_of(self, node: int, world_size: int) -> list[int]:
        per = world_size // self.nnodes
        return list(range(node * per, (node + 1) * per))


@dataclass(frozen=True)
class JobDescription:
    """What every host of one k3_lm must agree on; compared field by field at the rendezvous."""

    config_sha256: str
    weights_sha256: str
    tensor_parallel_size: int
    expert_parallel_size: int
    nnodes: int
    dtype: str
    dist_backend: str
    placement: str

    def differences(self, host: JobDescription) -> list[str]:
        return [f"{f.name}: worker {getattr(self, f.name)!r} != Triton host {getattr(host, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(host, f.name)]


def describe(checkpoint: str | Path, tp: int, ep: int, nnodes: int, dtype: str, backend: str,
             placement: str) -> JobDescription:
    """The job of this host, with a fingerprint of the checkpoint: sha256 of config.json, and of
    every weight file's name, size, safetensors header and first MiB of data (cheap on 1.5 TB, yet
    different for another export, quantization or seed)."""
    from k3backend.checkpoint import checkpoint_files

    path = Path(checkpoint)
    weights = hashlib.sha256()
    for f in checkpoint_files(path):
        with open(f, "rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
            weights.update(f"{f.name}:{f.stat().st_size}:".encode())
            weights.update(fh.read(header))
            weights.update(fh.read(SAMPLE_BYTES))
    config = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return JobDescription(config[:16], weights.hexdigest()[:16], tp, ep, nnodes, dtype, backend, placement)


class RemoteNode:
    """A joined node agent: its connection, the exits it reported, whether it is lost."""

    def __init__(self, node: int, host: str, pid: int, conn: Connection, ranks: list[int]) -> None:
        self.node, self.host, self.pid, self.conn, self.ranks = node, host, pid, conn, ranks
        self.exitcodes: dict[int, int] = {}
        self.lost: str | None = None
        self.heard = time.monotonic()
        self._send_lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"node {self.node} ({self.host})"

    def send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            self.lost = self.lost or "closed its connection"

    def poll(self, timeout: float = 0.0) -> None:
        """Read what the agent sent (answering heartbeats); mark it lost on EOF or silence."""
        if self.lost is not None:
            return
        try:
            while self.conn.poll(timeout):
                timeout = 0.0
                message = self.conn.recv()
                self.heard = time.monotonic()
                if message[0] == "died":
                    self.exitcodes[message[1]] = message[2]
                elif message[0] == "alive":
                    self.send(("alive",))
        except (EOFError, OSError):
            self.lost = "closed its connection"
            return
        silent = time.monotonic() - self.heard
        if silent > SILENCE_S:
            self.lost = f"sent nothing for {silent:.1f} s"

    def failure(self) -> str:
        return (f"{self.where}: its worker agent pid {self.pid} {self.lost} (host lost, network cut or agent "
                f"killed): lost worker rank {', '.join(map(str, self.ranks))}")


class RemoteRank:
    """A rank on another host as the coordinator sees it: the parts of `multiprocessing.Process` that
    `MultiProcessExecutor` uses, answered by its node agent."""

    sentinel = None  # nothing to wait on here: its connection's EOF and the agent's reports stand in

    def __init__(self, node: RemoteNode, rank: int, pid: int) -> None:
        self.node, self.rank, self.pid = node, rank, pid

    @property
    def where(self) -> str:
        return f" on {self.node.where}"

    @property
    def exitcode(self) -> int | None:
        return self.node.exitcodes.get(self.rank)

    def is_alive(self) -> bool:
        self.node.poll()
        return self.exitcode is None and self.node.lost is None

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            self.node.poll(min(0.05, max(0.0, deadline - time.monotonic())))


class Rendezvous:
    """The Triton host's side: the process groups' TCP store and, with other hosts, their admission."""

    def __init__(self, plan: NodePlan, world_size: int, template: WorkerSpec | None = None,
                 job: JobDescription | None = None) -> None:
        import torch.distributed as dist

        self.plan, self.world_size, self._template, self._job = plan, world_size, template, job
        timeout = datetime.timedelta(seconds=plan.dist_timeout_s)
        try:
            self.store = dist.TCPStore(plan.master_addr, plan.master_port, None, True, timeout=timeout,
                                       wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - DistNetworkError and friends: name the address
            raise WorkerFailure(f"cannot serve the rendezvous store at master_addr {plan.master_addr} master_port "
                                f"{plan.master_port}: {e}") from None
        self.address = (plan.master_addr, self.store.port)
        self.nodes: list[RemoteNode] = []
        self.refused: list[str] = []
        self._arrivals: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._joined: set[int] = set()
        self._deadline = time.monotonic() + plan.dist_timeout_s
        self._closed = False
        self._listener: Listener | None = None
        if plan.nnodes > 1:
            self._key = os.urandom(32)
            self._listener = Listener(("", 0), authkey=self._key)  # all interfaces, like the store
            self.store.set(STORE_KEY, json.dumps([self._listener.address[1], self._key.hex()]))
            self._thread = threading.Thread(target=self._accept_loop, name="k3-rendezvous", daemon=True)
            self._thread.start()
            log.info("k3_lm: waiting up to dist_timeout_s %g for node(s) 1..%d at %s:%d", plan.dist_timeout_s,
                     plan.nnodes - 1, *self.address)

    def _accept_loop(self) -> None:
        """Answer joins here; hand joined nodes and connecting ranks to the coordinator's thread."""
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError) as e:
                if self._closed:
                    return
                log.warning("k3_lm: rendezvous: refused a connection: %s", e)
                continue
            if self._closed:
                conn.close()
                return
            try:
                message = conn.recv() if conn.poll(10) else ("",)
            except (EOFError, OSError):
                message = ("",)
            if message[0] == "join":
                self._join(conn, *message[1:])
            elif message[0] == "hello":
                self._arrivals.put(("rank", *message[1:], conn))
            else:
                conn.close()

    def _join(self, conn: Connection, node: int, job: JobDescription, pid: int, host: str) -> None:
        if not 0 < node < self.plan.nnodes:
            why = [f"node_rank {node} is not in [1, {self.plan.nnodes - 1}] (nnodes {self.plan.nnodes})"]
        elif node in self._joined:
            why = [f"node_rank {node} has already joined"]
        else:
            why = job.differences(self._job)
        where = f"node {node} ({host}, agent pid {pid})"
        if why:
            text = f"{where} refused: " + "; ".join(why)
            log.error("k3_lm: %s", text)
            self.refused.append(text)
            try:
                conn.send(("refused", "; ".join(why)))
            except OSError:
                pass
            conn.close()
            return
        remote = RemoteNode(node, host, pid, conn, self.plan.ranks_of(node, self.world_size))
        self._joined.add(node)
        self._arrivals.put(("node", remote))  # before the welcome: its ranks' hellos come after it
        remote.send(("welcome", self._template, remote.ranks))
        log.info("k3_lm: %s joined: worker ranks %s", where, remote.ranks)

    def admit(self, conns: list, procs: list) -> None:
        """Take in what joined (coordinator's thread); WorkerFailure once nodes are missing past the deadline."""
        while True:
            try:
                item = self._arrivals.get_nowait()
            except queue.Empty:
                break
            if item[0] == "node":
                self.nodes.append(item[1])
                continue
            _, rank, pid, conn = item
            node = next((n for n in self.nodes if rank in n.ranks), None)
            if node is None or conns[rank] is not None:
                log.warning("k3_lm: rendezvous: unexpected worker rank %d pid %d; closing it", rank, pid)
                conn.close()
                continue
            conns[rank], procs[rank] = conn, RemoteRank(node, rank, pid)
        missing = sorted(set(range(1, self.plan.nnodes)) - self._joined)
        if missing and time.monotonic() > self._deadline:
            raise WorkerFailure(f"node(s) {missing} did not join within dist_timeout_s {self.plan.dist_timeout_s:g} "
                                f"at master_addr {self.address[0]} master_port {self.address[1]} (start "
                                f"`python -m k3backend worker` there)" + "".join(f"; {r}" for r in self.refused))

    def check(self) -> int | None:
        """A remote rank whose exit its agent reported (the caller names it); WorkerFailure for a lost
        node. Reads every node's messages, so it also answers their heartbeats."""
        for node in self.nodes:
            node.poll()
            if node.exitcodes:
                return min(node.exitcodes)
            if node.lost is not None:
                raise WorkerFailure(node.failure())
        return None

    def stop(self) -> None:
        """The engine ends: every node agent waits for its ranks (told already) and exits. Sent before the
        coordinator waits for its own ranks, so the agents never take that wait for a lost Triton host."""
        self._closed = True
        for node in self.nodes:
            node.send(("stop",))

    def close(self, timeout: float) -> None:
        """`stop()`, then wait up to `timeout` for the agents to go; shut the doors."""
        self.stop()
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            try:
                while wait([node.conn], max(0.0, deadline - time.monotonic())):
                    node.conn.recv()  # until EOF: the agent has exited
            except (EOFError, OSError):
                pass
            node.conn.close()
        if self._listener is not None:
            try:
                Client(("127.0.0.1", self._listener.address[1]), authkey=self._key).close()  # wakes accept()
            except OSError:
                pass
            self._listener.close()
            self._listener = None
            self._thread.join(2.0)
        self.store = None  # the server's socket closes with it
