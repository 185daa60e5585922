"""Seeded generator of hostile requests for k3_ensemble, k3_lm and k3_vision, over gRPC and HTTP
([ERR-5], SERVING.md §7.2), and the judge of their answers.

    fuzzer = Fuzzer(seed, Limits(...), {"canary_url": "http://127.0.0.1:<port>"})
    outcome = run_case(fuzzer.case(i), Sender(target, timeout_s))   # answers and problems
    tally.add(outcome); print(tally.table())

`Fuzzer.case(i)` depends only on (seed, i), so any case reproduces alone:

    .venv/bin/python tests/fuzz.py --seed S --index I --http http://127.0.0.1:8000 --grpc 127.0.0.1:8001

The classes live in fuzz_sampling (sampling values and their JSON), fuzz_text (prompts,
messages, UTF-8, stop requests), fuzz_images (image inputs and embeddings) and fuzz_protocol
(Triton-level garbage, protocol abuse); fuzz_wire sends and classifies. No INTERNAL, hang, lost or duplicated response is ever legitimate; Triton's own HTTP
parser errors (500, "Unable to parse ...") are legitimate only where a case expects them and are
counted apart (`TRITON_500`).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import fuzz_images
import fuzz_protocol
import fuzz_sampling
import fuzz_text
from fuzz_gen import Case, Gen, Limits
from fuzz_wire import FAILURES, Answer, Request, Sender, Target, infer_request_proto

CLASSES = fuzz_sampling.CLASSES + fuzz_text.CLASSES + fuzz_images.CLASSES + fuzz_protocol.CLASSES
ENDPOINTS = {"http_generate": "generate", "http_stream": "generate_stream", "http_infer": "infer"}


class Fuzzer:
    """The case stream of one seed: case i is drawn from the weighted classes by Random(seed:i).

    known_defects: also draw fuzz_protocol.BATCH_POISON, which Triton 2.51's Python backend fails
    for every request batched with it (test_fuzz.py pins it with a strict xfail).
    """

    def __init__(self, seed: int, limits: Limits, extras: dict, known_defects: bool = False) -> None:
        self.seed, self.limits, self.extras = seed, limits, extras
        classes = CLASSES + (fuzz_protocol.BATCH_POISON if known_defects else [])
        self._classes = [c for c, _ in classes]
        self._weights = [w for _, w in classes]

    def case(self, index: int) -> Case:
        g = Gen(self.seed, index, self.limits, self.extras)
        return g.rng.choices(self._classes, self._weights)[0](g)


@dataclass
class Outcome:
    """A case's answers (one per request, then one per cleanup stop) and what was wrong with them."""

    case: Case
    answers: list[Answer]
    cleanup: list[Answer] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def run_case(case: Case, sender: Sender) -> Outcome:
    """Send a case as its action says, then its cleanup stops; judge every answer."""
    try:
        answers = _send(case, sender)
    except Exception as e:  # noqa: BLE001 - a case the client cannot even send is a harness bug
        answers = [Answer("client_error", "-", f"{type(e).__name__}: {e}")]
    cleanup = [sender.stream([stop])[0] for stop in case.cleanup]
    outcome = Outcome(case, answers, cleanup)
    outcome.problems = judge(case, answers) + [f"cleanup stop: {p}" for p in _judge_all(cleanup, frozenset({"ok"}))]
    return outcome


def _send(case: Case, sender: Sender) -> list[Answer]:
    first = case.requests[0]
    if case.action == "cancel":
        return sender.stream(case.requests, cancel_after_s=case.delay_s)
    if case.action == "drop":
        return [sender.raw_stream(_with_proto(first), drop_after_s=case.delay_s)]
    if case.action == "abandon":
        return [sender.http_abandon(first, ENDPOINTS[case.protocol], **case.options)]
    if case.action == "race" or case.protocol == "grpc":
        return sender.stream(case.requests, stagger_s=case.delay_s)
    if case.action == "parallel":
        return _parallel(case, sender)
    if case.protocol == "grpc_raw":
        return [sender.raw_stream(_with_proto(r)) for r in case.requests]
    if case.protocol == "grpc_infer":
        return [sender.infer(r) for r in case.requests]
    return [sender.http(r, ENDPOINTS[case.protocol]) for r in case.requests]


def _with_proto(request: Request) -> Request:
    if request.raw is None:
        request.raw = infer_request_proto(request)
    return request


def _parallel(case: Case, sender: Sender) -> list[Answer]:
    """HTTP requests from one thread each, started `delay_s` apart (a stop racing its target)."""
    answers: list[Answer | None] = [None] * len(case.requests)

    def one(i: int) -> None:
        answers[i] = sender.http(case.requests[i], ENDPOINTS[case.protocol])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(case.requests))]
    for t in threads:
        t.start()
        threading.Event().wait(case.delay_s)
    for t in threads:
        t.join(sender.timeout_s + 5)
    return [a or Answer("hang", "thread") for a in answers]


# The status each k3 code may come with, per protocol (SERVING.md §7.3). Triton 2.51's /generate
# answers 400 for every model error (README "Error status codes", tests/test_triton_error_codes.py);
# 501 / 503 are what a later Triton that keeps the code would send.
_GENERATE = {"ok": {"200"}, "INVALID_ARG": {"400"}, "UNSUPPORTED": {"400", "501"}, "UNAVAILABLE": {"400", "503"},
             "CANCELLED": {"400"}}
STATUSES = {
    "http_generate": _GENERATE, "http_stream": _GENERATE,
    "http_infer": {"ok": {"200"}, "INVALID_ARG": {"400"}, "UNSUPPORTED": {"501"}, "UNAVAILABLE": {"503"}},
    "grpc_infer": {"ok": {"StatusCode.OK"}, "INVALID_ARG": {"StatusCode.INVALID_ARGUMENT"},
                   "UNSUPPORTED": {"StatusCode.UNIMPLEMENTED"}, "UNAVAILABLE": {"StatusCode.UNAVAILABLE"}},
}


def judge(case: Case, answers: list[Answer]) -> list[str]:
    problems = _judge_all(answers, case.expect)
    allowed = STATUSES.get(case.protocol, {})
    for a in answers:
        if a.code in allowed and a.status not in allowed[a.code]:
            problems.append(f"{a.code} came with status {a.status}, expected {sorted(allowed[a.code])}: {a.message[:200]}")
    if len(answers) != len(case.requests) and case.action != "drop":
        problems.append(f"{len(answers)} answers for {len(case.requests)} requests")
    if case.finish:
        reason, n = case.finish
        got = [a.finish for a in answers]
        if sum(f == reason for f in got) < n:
            problems.append(f"expected {n} request(s) to finish {reason!r}, got finish reasons {got}")
    return problems


def _judge_all(answers: list[Answer], expect: frozenset[str]) -> list[str]:
    return [f"{a.code} (status {a.status}) not in {sorted(expect)}: {a.message[:300]}"
            for a in answers if a.code in FAILURES or a.code not in expect]


def describe(case: Case, seed: int) -> str:
    """One line that identifies and reproduces a case."""
    parts = []
    for r in case.requests:
        shown = {k: (v if len(repr(v)) < 80 else repr(v)[:77] + "...") for k, v in r.values.items()}
        parts.append(f"{r.model} id={r.request_id!r} {shown if r.body is None else r.body[:120]!r}")
    return (f"seed={seed} index={case.index} {case.kind} via {case.protocol} ({case.action}, "
            f"delay {case.delay_s}s): " + " | ".join(parts))


class Tally:
    """Requests by (answer code, status) and model; the table quoted in reports. Thread-safe."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.triton_500: Counter[str] = Counter()
        self.failed: list[tuple[Outcome, str]] = []
        self.cases = 0
        self.slowest = 0.0
        self._lock = threading.Lock()

    def add(self, outcome: Outcome, seed: int) -> None:
        with self._lock:
            self.cases += 1
            for request, answer in zip(outcome.case.requests, outcome.answers):
                self._count(request.model, answer)
            for stop, answer in zip(outcome.case.cleanup, outcome.cleanup):
                self._count(stop.model, answer)
            for problem in outcome.problems:
                self.failed.append((outcome, f"{describe(outcome.case, seed)}\n    -> {problem}"))

    def _count(self, model: str, answer: Answer) -> None:
        model = model if model in ("k3_ensemble", "k3_lm", "k3_vision") else "(other)"
        self.counts[(answer.code, answer.status, model)] += 1
        self.slowest = max(self.slowest, answer.seconds)
        if answer.code == "TRITON_500":
            self.triton_500[answer.message.split(":")[0][:60]] += 1

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    def count(self, code: str) -> int:
        return sum(n for (c, _, _), n in self.counts.items() if c == code)

    def table(self) -> str:
        models = ("k3_ensemble", "k3_lm", "k3_vision", "(other)")
        rows = sorted({(c, s) for c, s, _ in self.counts}, key=lambda cs: (cs[0] != "ok", cs))
        lines = [f"{'answer':<16} {'status':<28} " + " ".join(f"{m:>11}" for m in models) + f" {'total':>7}"]
        for code, status in rows:
            per = [self.counts[(code, status, m)] for m in models]
            lines.append(f"{code:<16} {status:<28} " + " ".join(f"{n:>11}" for n in per) + f" {sum(per):>7}")
        lines.append(f"{'all':<16} {'':<28} " + " ".join(
            f"{sum(n for (_, _, m), n in self.counts.items() if m == model):>11}" for model in models)
            + f" {self.requests:>7}")
        lines.append(f"{self.cases} cases, {self.requests} requests; never legitimate: "
                     + ", ".join(f"{code} {self.count(code)}" for code in sorted(FAILURES))
                     + f"; slowest answer {self.slowest:.1f} s")
        if self.triton_500:
            lines.append("TRITON_500 (Triton's HTTP JSON parser, counted apart): "
                         + "; ".join(f"{n} x {msg!r}" for msg, n in self.triton_500.most_common()))
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Re-send one case of a seed to a running server and print its answers."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--http", default="http://127.0.0.1:8000")
    ap.add_argument("--grpc", default="127.0.0.1:8001")
    ap.add_argument("--canary-url", default="http://127.0.0.1:9", help="the loopback URL the case was made with")
    args = ap.parse_args(argv)
    case = Fuzzer(args.seed, Limits(), {"canary_url": args.canary_url}).case(args.index)
    sender = Sender(Target(args.http, args.grpc), timeout_s=60)
    try:
        outcome = run_case(case, sender)
    finally:
        sender.close()
    print(describe(case, args.seed))
    for answer in outcome.answers + outcome.cleanup:
        print(f"  {answer.code} {answer.status} {answer.finish or ''} {answer.message[:500]}")
    for problem in outcome.problems:
        print("  PROBLEM:", problem)
    return 1 if outcome.problems else 0


if __name__ == "__main__":
    sys.exit(main())
