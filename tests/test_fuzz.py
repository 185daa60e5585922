"""[ERR-5] / [CMP-16] isolation fuzz against a real tritonserver: hostile traffic of every §7.2
class, Triton-level garbage and protocol abuse (tests/fuzz.py) runs concurrently with valid
greedy and seeded streams through k3_ensemble and k3_lm, some with images.

The server runs with max_num_seqs=1, so a valid stream's text cannot depend on what it was
batched with: it must equal the same request sent alone before the fuzz. Every fuzz answer must
be one its case allows (never INTERNAL, never a hang), and afterwards the server is ready, idle,
has counted no INTERNAL and logged no crash or traceback.

K3_FUZZ_SEED and K3_FUZZ_CASES override the fixed seed and the case count; a failing case
prints the line that reproduces it alone (tests/fuzz.py --seed --index).

A defect the fuzz found that is not ours to fix (Triton 2.51's Python backend fails a whole
k3_vision batch for one request's overstated BYTES length) stays out of the mix and is pinned here
by a strict xfail: it passes only while the defect is there, so a Triton that fixes it fails it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import fuzz_protocol
from fuzz import Fuzzer, run_case
from fuzz_gen import PLACEHOLDER, Gen
from fuzz_run import (
    MODELS,
    Canary,
    FuzzPool,
    ValidTraffic,
    fuzz_repository,
    internal_count,
    limits_of,
    log_size,
    precomputed_embeddings,
    run_valid,
    sample_png,
    server_problems,
    valid_jobs,
)
from fuzz_wire import Answer, Request, Sender, Target

SEED = int(os.environ.get("K3_FUZZ_SEED", "20261201"))
CASES = int(os.environ.get("K3_FUZZ_CASES", "400"))
WORKERS = 6
VALID_CONCURRENCY = 2  # valid streams in flight during the fuzz (the engine runs one at a time)
MAX_TOKENS = 16
TIMEOUT_S = 60.0  # an answer later than this is a hang


@pytest.fixture(scope="module")
def fuzz_server(triton_server, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("ckpt") / "tiny-seed0"
    os.environ["K3_DEFAULT_CHECKPOINT"] = str(checkpoint)
    repo = fuzz_repository(tmp_path_factory.mktemp("fuzz") / "repo")
    server = triton_server(repo, MODELS)
    return server, limits_of(repo, checkpoint)


def test_ERR5_fuzz_does_not_disturb_valid_streams(fuzz_server, report):
    server, limits = fuzz_server
    target = Target(server.http_url, server.grpc_url)
    png = sample_png()
    jobs = valid_jobs(precomputed_embeddings(target, png), png, MAX_TOKENS)
    alone = {job.name: run_valid(job, target, f"alone-{job.name}", TIMEOUT_S) for job in jobs}
    problems = [p for result in alone.values() for p in result.problems(None)]
    assert not problems, problems

    canary = Canary()
    offset, internal = log_size(server.log_path), internal_count(server.metrics_url)
    start = time.monotonic()
    valid = ValidTraffic(target, jobs, {name: r.text for name, r in alone.items()}, VALID_CONCURRENCY, TIMEOUT_S)
    valid.start()
    try:
        tally = FuzzPool(target, Fuzzer(SEED, limits, {"canary_url": canary.url}), WORKERS, TIMEOUT_S,
                         count=CASES).run()
    finally:
        valid.stop()
        canary.close()
    took = time.monotonic() - start

    report(f"[ERR-5] fuzz seed {SEED}: {CASES} cases in {took:.1f} s, {WORKERS} workers\n{tally.table()}\n"
           f"{valid.summary()}")
    failures = [line for _, line in tally.failed]
    assert not failures, f"{len(failures)} fuzz answers not allowed:\n" + "\n".join(failures[:20])
    assert not valid.problems, valid.problems[:20]
    ran = {r.job.name for r in valid.results}
    assert ran == {job.name for job in jobs}, f"valid jobs that never ran during the fuzz: {ran}"
    assert canary.hits == 0, f"{canary.hits} connection(s) to a refused loopback image URL"
    assert tally.count("ok") and tally.count("INVALID_ARG") and tally.count("TRITON"), tally.table()
    problems = server_problems(target, server.metrics_url, server.log_path, offset, internal)
    assert not problems, problems


@pytest.mark.parametrize("fuzz_class", [fuzz_protocol.http_id_utf8, fuzz_protocol.http_parameter_utf8],
                         ids=lambda c: c.__name__)
def test_ids_and_parameters_that_are_not_utf8_are_client_errors(fuzz_server, fuzz_class):
    """[ERR-3]: a request id or parameter that is not UTF-8 (HTTP lets a client send any bytes there)
    is INVALID_ARG from every model, never INTERNAL or an exception out of execute (found by this fuzz)."""
    server, limits = fuzz_server
    sender = Sender(Target(server.http_url, server.grpc_url), TIMEOUT_S)
    try:
        outcomes = [run_case(fuzz_class(Gen(SEED, i, limits, {"canary_url": "http://127.0.0.1:9"})), sender)
                    for i in range(12)]
    finally:
        sender.close()
    problems = [p for outcome in outcomes for p in outcome.problems]
    assert not problems, problems


@pytest.mark.xfail(strict=True, reason="Triton 2.51 Python backend defect, with the dynamic batching that k3_vision's "
                   "config requires: a request whose BYTES length prefix overstates its data passes core and fails "
                   "every request of its k3_vision batch with its own 'incomplete string data' error, text-only "
                   "ensemble requests included (docs/errors.md). Remove this mark (and add "
                   "fuzz_protocol.BATCH_POISON to CLASSES) on a Triton that fixes it.")
def test_known_defect_bad_request_does_not_fail_its_vision_batch(fuzz_server):
    """[VIS-7], [ERR-5]: one malformed request fails only itself, whatever it is batched with."""
    server, _ = fuzz_server
    errors = _poisoned_batches(Target(server.http_url, server.grpc_url), max_rounds=48)  # 16 missed once
    assert not errors, f"{len(errors)} valid k3_vision requests failed: {errors[:2]}"


def _poisoned_batches(target: Target, max_rounds: int) -> list[str]:
    """Each round keeps both k3_vision instances busy with an image, then queues one poisoned and
    eight valid text-only requests behind them, so the dynamic batcher groups them; returns the
    errors the valid ones got. Whether the poisoned request shares a batch depends on timing (an
    image can finish before the rest is queued), so rounds go on until one shows an error or
    `max_rounds` have run."""
    pixels = np.random.default_rng(0).integers(0, 256, (1, 1, 448, 448, 3), dtype=np.uint8)
    busy = Request("k3_vision", {"text_input": PLACEHOLDER, "image_bytes_input": pixels})
    senders = [Sender(target, TIMEOUT_S) for _ in range(11)]
    errors: list[str] = []
    try:
        for r in range(max_rounds):
            valid = [Request("k3_vision", {"text_input": f"round {r} request {i}"}, f"valid-{r}-{i}") for i in range(8)]
            poisoned = fuzz_protocol.overstate_bytes_length(Request("k3_vision", {"text_input": "poison"}, f"bad-{r}"))
            answers: dict[str, Answer] = {}
            calls = [(busy, senders[0].infer), (busy, senders[1].infer), (poisoned, senders[2].raw_infer)]
            calls += [(request, sender.infer) for request, sender in zip(valid, senders[3:])]
            threads = [threading.Thread(target=lambda q=q, send=send: answers.__setitem__(q.request_id, send(q)))
                       for q, send in calls]
            for i, t in enumerate(threads):
                t.start()
                if i == 1:
                    time.sleep(0.05)  # the images are in both instances before the rest arrives
            for t in threads:
                t.join(TIMEOUT_S)
            errors += [f"{rid}: {a.code} {a.message[:150]}" for rid, a in answers.items()
                       if rid.startswith("valid") and a.code != "ok"]
            if errors:
                break
    finally:
        for sender in senders:
            sender.close()
    return errors
