"""The node agent: `python -m k3backend worker` on a host other than the Triton host (`engine.nodes`).

It joins the Triton host's rendezvous, spawns this host's ranks with the code of the local ones
(`workers.worker_main`, each connecting to the coordinator itself), reports their exits, keeps
the heartbeat, and stops them when the engine ends or the Triton host is lost.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from dataclasses import replace
from multiprocessing.connection import Client, Connection, wait

from k3backend.engine.nodes import HEARTBEAT_S, SILENCE_S, STORE_KEY, NodePlan, describe
from k3backend.engine.workers import Spawner, WorkerSpec, stop_processes, visible_gpu, worker_main

log = logging.getLogger(__name__)


def connect_rank(spec: WorkerSpec) -> Connection:
    """A remote rank's connection to the coordinator, standing in for a local rank's pipe."""
    host, port, key = spec.coordinator
    conn = Client((host, port), authkey=key)
    conn.send(("hello", spec.rank, os.getpid()))
    return conn


def run_node(checkpoint: str, plan: NodePlan, node_rank: int, tp: int, ep: int, device: str, dtype: str,
             backend: str, placement: str = "tp") -> int:
    """Join the Triton host's k3_lm as node `node_rank`, run this host's ranks until the engine ends.

    Exit status: 0 when the engine stopped the ranks, 1 when a rank or the Triton host was lost, 2
    when the Triton host could not be reached or refused this worker."""
    import torch.distributed as dist

    job = describe(checkpoint, tp, ep, plan.nnodes, dtype, backend, placement)
    log.info("node %d: joining %s:%d (dist_timeout_s %g) with %s", node_rank, plan.master_addr, plan.master_port,
             plan.dist_timeout_s, job)
    try:
        store = dist.TCPStore(plan.master_addr, plan.master_port, None, False,
                              timeout=datetime.timedelta(seconds=plan.dist_timeout_s))
        port, key = json.loads(store.get(STORE_KEY))
        del store
        conn = Client((plan.master_addr, port), authkey=bytes.fromhex(key))
        conn.send(("join", node_rank, job, os.getpid(), socket.gethostname()))
        reply = conn.recv() if conn.poll(plan.dist_timeout_s) else ("refused", "no answer within dist_timeout_s")
    except Exception as e:  # noqa: BLE001 - DistNetworkError, timeouts, refused connections
        log.error("node %d: cannot reach the Triton host at %s:%d within dist_timeout_s %g: %s", node_rank,
                  plan.master_addr, plan.master_port, plan.dist_timeout_s, e)
        return 2
    if reply[0] == "refused":
        log.error("node %d: refused by the Triton host: %s", node_rank, reply[1])
        return 2
    _, template, ranks = reply
    spawner = Spawner("k3-node-ranks")
    procs: dict[int, object] = {}
    rc = 1
    try:
        for i, rank in enumerate(ranks):
            spec = replace(template, rank=rank, gpu=None if device == "cpu" else visible_gpu(i),
                           checkpoint=str(checkpoint), store=(plan.master_addr, plan.master_port),
                           coordinator=(plan.master_addr, port, bytes.fromhex(key)))
            procs[rank] = spawner.spawn(worker_main, (spec, None), f"k3-rank{rank}")
            log.info("node %d: worker rank %d pid %d", node_rank, rank, procs[rank].pid)
        rc = _watch(conn, procs, node_rank)
        return rc
    finally:  # told to stop, the ranks are on their way out; else nobody will tell them
        stop_processes(list(procs.values()), timeout=10.0 if rc == 0 else 0.5)
        spawner.close()
        conn.close()
        log.info("node %d: every worker rank has exited", node_rank)


def _watch(conn: Connection, procs: dict, node_rank: int) -> int:
    """Heartbeats both ways, rank exits reported; until "stop", the Triton host's loss, or no rank left."""
    watched = {p.sentinel: rank for rank, p in procs.items()}
    heard = beat = time.monotonic()
    failed = False
    try:
        while watched:
            if time.monotonic() >= beat:
                conn.send(("alive",))
                beat = time.monotonic() + HEARTBEAT_S
            for obj in wait([conn, *watched], HEARTBEAT_S):
                if obj is conn:
                    if conn.recv()[0] == "stop":
                        log.info("node %d: the engine stopped", node_rank)
                        return 1 if failed else 0
                    heard = time.monotonic()
                    continue
                rank = watched.pop(obj)
                p = procs[rank]
                p.join(1.0)
                failed |= p.exitcode != 0
                if p.exitcode != 0:
                    log.error("node %d: worker rank %d pid %d exited (exit status %s)", node_rank, rank, p.pid,
                              p.exitcode)
                conn.send(("died", rank, p.exitcode))
            if time.monotonic() - heard > SILENCE_S:
                log.error("node %d: nothing from the Triton host for %.1f s; stopping the ranks", node_rank,
                          time.monotonic() - heard)
                return 1
    except (EOFError, OSError):
        log.error("node %d: the Triton host closed the connection; stopping the ranks", node_rank)
        return 1
    return 1 if failed else 0
