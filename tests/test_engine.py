"""Engine: batched, chunked generation equals the single-request loop; events, termination, cancellation, failure.

Spec: SERVING.md §5.4–5.10, §6.3, §8.3–8.4. Reference outputs come from `k3backend.generate.generate`.
Batching and chunked prefill change fp32 logits in the last bits (GEMMs of another shape, chunked vs
recurrent KDA), so the tests that compare such runs token for token use a float64 model.
"""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import pytest
import torch

from k3backend.checkpoint import load_model
from k3backend.detokenizer import IncrementalDetokenizer, detokenize_all
from k3backend.engine.config import EngineConfig
from k3backend.engine.engine import Engine
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.request import FinishReason, Request, RequestOutput
from k3backend.engine.sampling_params import SamplingParams
from k3backend.errors import Cancelled, InvalidArgument, Unavailable
from k3backend.generate import generate
from k3backend.presets import make_checkpoint
from k3backend.tokenizer import Tokenizer

WAIT_S = 30.0


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops on a 2-core box are ~20x slower with several torch threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_engine"))


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def model32(ckpt):
    return load_model(ckpt, progress=False)


@pytest.fixture(scope="module")
def model64(ckpt):
    return load_model(ckpt, dtype=torch.float64, progress=False)


@pytest.fixture
def make_engine():
    """Factory for engines that are closed (and checked for a joined thread) after the test."""
    engines: list[Engine] = []

    def make(model, tok, **cfg) -> Engine:
        engines.append(new_engine(model, tok, **cfg))
        return engines[-1]

    yield make
    for e in engines:
        e.close()
        assert not any(t.is_alive() for t in e._threads)


def new_engine(model, tok, **cfg) -> Engine:
    c = EngineConfig(**{"max_model_len": 1024, "cpu_cache_gb": 0.25, **cfg})
    return Engine(InProcessExecutor(model, c), tok, c)


class Collector:
    """on_output target: events per request, and a wait for every final one."""

    def __init__(self) -> None:
        self.events: dict[str, list[RequestOutput]] = {}
        self._done: dict[str, threading.Event] = {}
        self.hook = None  # called with each event on the engine thread

    def __call__(self, out: RequestOutput) -> None:
        self.events.setdefault(out.request_id, []).append(out)
        if out.finished:
            self._done.setdefault(out.request_id, threading.Event()).set()
        if self.hook is not None:
            self.hook(out)

    def wait(self, *ids: str) -> dict[str, list[RequestOutput]]:
        for rid in ids:
            assert self._done.setdefault(rid, threading.Event()).wait(WAIT_S), f"request {rid} did not finish"
        return {rid: self.events[rid] for rid in ids}


def check_events(events: list[RequestOutput]) -> RequestOutput:
    """Protocol invariants ([STR-3], [STR-9]); returns the merged output."""
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    for e in events[:-1]:
        assert e.text or e.reasoning, "a non-final event must carry text ([STR-3])"
        assert e.finish_reason is None
    ids = [t for e in events for t in e.token_ids]
    logprobs = None if events[-1].logprobs is None else [lp for e in events for lp in e.logprobs]
    if logprobs is not None:
        assert [lp.token for lp in logprobs] == ids
    last = events[-1]
    return RequestOutput(last.request_id, "".join(e.text for e in events), "".join(e.reasoning for e in events),
                         ids, logprobs, True, last.finish_reason, last.error, last.num_input_tokens,
                         last.num_cached_tokens)


def run(engine: Engine, requests: list[Request]) -> dict[str, RequestOutput]:
    col = Collector()
    for r in requests:
        engine.submit(r, col)
    return {rid: check_events(evs) for rid, evs in col.wait(*[r.request_id for r in requests]).items()}


def reference(model, req: Request) -> list[int]:
    return [s.token for s in generate(model, req.prompt_ids, req.params, eos_ids=req.eos_ids,
                                      image_embeds=req.image_embeds, bad_word_seqs=req.bad_word_seqs)]


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.healthy) == (0, 0, True)


def prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, allow_special=True)


# ---- same tokens as the single-request loop ----------------------------------------------------

CASES = {
    "greedy": (SamplingParams(max_tokens=12, temperature=0.0, logprobs=3), {}),
    "seeded": (SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                              repetition_penalty=1.1, frequency_penalty=0.2), {}),
    "reasoning": (SamplingParams(max_tokens=12, temperature=0.8, seed=7), {"split_reasoning": True, "in_think": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_single_request_equals_generate(model32, tok, make_engine, case):
    params, extra = CASES[case]
    req = Request("r", prompt(tok, "The quick brown fox jumps over"), params, eos_ids=(tok.eos_id,), **extra)
    out = run(make_engine(model32, tok), [req])["r"]
    ref = list(generate(model32, req.prompt_ids, params, eos_ids=req.eos_ids))
    assert out.token_ids == [s.token for s in ref]
    eos = out.token_ids[-1] == tok.eos_id
    assert out.finish_reason is (FinishReason.STOP if eos else FinishReason.LENGTH)
    shown = out.token_ids[:-1] if eos else out.token_ids
    text, reasoning, _ = detokenize_all(tok, shown, **extra)
    assert (out.text, out.reasoning) == (text, reasoning)
    assert (out.reasoning if extra.get("split_reasoning") else out.text) != ""
    assert out.num_input_tokens == len(req.prompt_ids)
    if params.logprobs is not None:
        assert [lp.logprob for lp in out.logprobs] == [s.logprob for s in ref]
        assert all(lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == lp.token for lp in out.logprobs)
    else:
        assert out.logprobs is None


def test_concurrent_requests_equal_their_run_alone_tokens(model64, tok, make_engine):
    """8 requests, at most 4 running: admissions happen while others decode. float64: see the module doc."""
    reqs = [Request(f"r{i}", prompt(tok, f"request {i}: " + "abcdefgh"[:i + 1] * (i + 1)),
                    SamplingParams(max_tokens=6 + i % 3, temperature=0.0 if i % 2 else 1.0, seed=100 + i,
                                   logprobs=1 if i == 3 else None))
            for i in range(8)]
    outs = run(make_engine(model64, tok, max_num_seqs=4), reqs)
    for r in reqs:
        assert outs[r.request_id].token_ids == reference(model64, r), r.request_id


def test_chunked_prefill_equals_generate(model64, tok, make_engine):
    """A 7-token budget splits both prompts into chunks, and two sequences share prefill steps."""
    reqs = [Request(f"r{i}", prompt(tok, text), SamplingParams(max_tokens=5, temperature=0.7, seed=i))
            for i, text in enumerate(["a prompt that is much longer than seven tokens", "and a second one"])]
    engine = make_engine(model64, tok, max_num_batched_tokens=7)
    outs = run(engine, reqs)
    for r in reqs:
        assert outs[r.request_id].token_ids == reference(model64, r)
    assert engine.stats().steps > len(reqs[0].prompt_ids) // 7


@pytest.mark.parametrize("chunk", [None, 3], ids=["one-prefill", "chunked"])
def test_image_embeddings_replace_media_pads(model64, tok, make_engine, chunk):
    pad = tok.media_pad_id
    ids = prompt(tok, "look:") + [pad] * 4 + prompt(tok, " and ") + [pad] * 3 + prompt(tok, "?")
    embeds = torch.randn(7, model64.cfg.text.hidden_size, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64)
    req = Request("img", ids, SamplingParams(max_tokens=6, temperature=0.0), image_embeds=embeds)
    engine = make_engine(model64, tok, **({} if chunk is None else {"max_num_batched_tokens": chunk}))
    assert run(engine, [req])["img"].token_ids == reference(model64, req)
    assert reference(model64, req) != reference(model64, replace(req, image_embeds=embeds * 2))


# ---- termination -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_ref(model32, tok):
    """A greedy request whose output has some visible ASCII, and its 24 reference tokens (EOS ignored)."""
    req = Request("g", prompt(tok, "Once upon a time"),
                  SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), eos_ids=(tok.eos_id,))
    return req, reference(model32, req)


def test_stop_string_ends_with_stop_and_truncates(model32, tok, make_engine, greedy_ref):
    req, ref = greedy_ref
    full, _, _ = detokenize_all(tok, ref)
    j = next(i for i in range(2, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    stop = full[j:j + 2]  # two characters: the first one is held back until the second arrives
    j = full.index(stop)
    detok = IncrementalDetokenizer(tok, stop_strings=[stop])
    n = next(k for k in range(1, len(ref) + 1) if detok.push([ref[k - 1]]).stopped)  # token completing the match
    engine = make_engine(model32, tok)
    for include in (False, True):
        params = replace(req.params, stop=(stop,), include_stop_str_in_output=include)
        out = run(engine, [replace(req, params=params)])["g"]
        assert out.finish_reason is FinishReason.STOP
        assert out.token_ids == ref[:n]
        assert out.text == full[:j + (len(stop) if include else 0)]


def test_min_tokens_suspends_stop_strings(model32, tok, make_engine, greedy_ref):
    req, ref = greedy_ref
    full, _, _ = detokenize_all(tok, ref[:6])
    stop = next(c for c in full if c != "\ufffd")
    params = replace(req.params, stop=(stop,), min_tokens=20)
    out = run(make_engine(model32, tok), [replace(req, params=params)])["g"]
    unstopped = reference(model32, replace(req, params=replace(params, stop=())))  # min_tokens also masks EOS
    assert stop in detokenize_all(tok, unstopped[:6])[0]
    assert len(out.token_ids) >= 20 and out.token_ids[:20] == unstopped[:20]


@pytest.mark.parametrize("how", ["end_id", "stop_token_ids", "eos_ids"])
def test_stop_token_ends_with_stop_and_no_text(model32, tok, make_engine, greedy_ref, how):
    req, ref = greedy_ref
    target = ref[2]
    params = replace(req.params, ignore_eos=False, end_id=target if how == "end_id" else None,
                     stop_token_ids=(target,) if how == "stop_token_ids" else ())
    stopping = replace(req, params=params, eos_ids=(target,) if how == "eos_ids" else (tok.eos_id,))
    expected = reference(model32, stopping)
    assert expected[-1] == target and len(expected) <= 3
    # ignore_eos + min_tokens = max_tokens: exactly max_tokens tokens, the stop ids masked ([STP-4], [STP-5])
    exact = replace(stopping, request_id="x", params=replace(params, ignore_eos=True, min_tokens=params.max_tokens))
    outs = run(make_engine(model32, tok), [stopping, exact])
    assert outs["g"].finish_reason is FinishReason.STOP and outs["g"].token_ids == expected
    assert outs["g"].text == detokenize_all(tok, expected[:-1])[0]  # the stop token has no text ([STP-2])
    assert outs["x"].finish_reason is FinishReason.LENGTH
    assert len(outs["x"].token_ids) == params.max_tokens and target not in outs["x"].token_ids
    assert outs["x"].text == detokenize_all(tok, outs["x"].token_ids)[0]


# ---- cancellation ------------------------------------------------------------------------------

def long_request(req: Request, request_id: str = "g") -> Request:
    return replace(req, request_id=request_id, params=replace(req.params, max_tokens=200))


def test_stop_mid_generation_flushes_held_text(model32, tok, make_engine, greedy_ref, monkeypatch):
    """stop() lands while the last token's text is held back for a stop-string prefix: the final event has it."""
    req, ref = greedy_ref
    k = next(i for i in range(3, len(ref))
             if 33 <= ref[i] < 127 and detokenize_all(tok, ref[:i + 1])[0].endswith(chr(ref[i])))
    held = chr(ref[k]) + "\x01\x02\x03"  # never completes: only its first character is ever held back
    engine = make_engine(model32, tok)
    lm, counts = model32.language_model, []

    def forward(*args, **kwargs):  # forward k+1 samples ref[k]; the stop lands at the end of that step
        if len(counts) < k + 1:
            counts.append(engine.stop("g") if len(counts) == k else None)
        return type(lm).forward(lm, *args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)
    col = Collector()
    long = long_request(req)
    engine.submit(replace(long, params=replace(long.params, stop=(held,))), col)
    events = col.wait("g")["g"]
    out = check_events(events)
    assert counts[k] == 1
    assert out.finish_reason is FinishReason.CANCELLED
    assert out.token_ids == ref[:k + 1]
    assert events[-1].text.endswith(chr(ref[k])) and out.text == detokenize_all(tok, ref[:k + 1])[0]
    assert_idle(engine)


@pytest.mark.parametrize("cancel", ["stop", "abort"])
def test_cancel_matches_running_and_queued_requests_with_the_id(model32, tok, make_engine, greedy_ref, cancel):
    """max_num_seqs=1: one request with the id runs, another waits; both end CANCELLED ([CAN-6]).

    stop() matches the client id; abort() one engine id ([CAN-1]) and ends with a CANCELLED error."""
    req, _ = greedy_ref
    engine = make_engine(model32, tok, max_num_seqs=1)
    first, second, gate, done = Collector(), Collector(), threading.Event(), []
    keys = []

    def hook(out: RequestOutput) -> None:  # on the output thread: the next step boundary applies it
        if not done:
            gate.wait(WAIT_S)
            done.append(engine.stop("g") if cancel == "stop" else [engine.abort(k) for k in keys])

    first.hook = hook
    keys += [engine.submit(long_request(req), first), engine.submit(long_request(req), second)]
    assert engine.stop("nobody") == 0
    gate.set()
    running, queued = check_events(first.wait("g")["g"]), check_events(second.wait("g")["g"])
    assert done == [2] if cancel == "stop" else done == [[None, None]]
    assert running.finish_reason is queued.finish_reason is FinishReason.CANCELLED
    assert 0 < len(running.token_ids) < 200 and queued.token_ids == []
    if cancel == "abort":
        assert isinstance(running.error, Cancelled) and isinstance(queued.error, Cancelled)
    else:
        assert running.error is None and queued.error is None
    assert_idle(engine)


def test_stop_before_arrival_leaves_a_tombstone_consumed_once(model32, tok, make_engine, greedy_ref):
    """[CAN-7]: an unmatched stop cancels the next request with that id, without engine work; only that one."""
    req, ref = greedy_ref
    engine = make_engine(model32, tok)
    assert engine.stop("g") == 0
    col = Collector()
    engine.submit(req, col)
    out = check_events(col.wait("g")["g"])
    assert (out.finish_reason, out.token_ids, out.text, out.error) == (FinishReason.CANCELLED, [], "", None)
    assert engine.stats().steps == 0
    col2 = Collector()
    engine.submit(req, col2)
    assert check_events(col2.wait("g")["g"]).token_ids == ref


def test_unmatched_stops_are_bounded_in_count_and_bytes(model32, tok, make_engine, monkeypatch):
    """[CAN-7] tombstones are client-chosen ids: a flood of long unmatched stop ids keeps at most
    MAX_TOMBSTONES digests of 16 bytes, the oldest dropped first, and each still works until then."""
    import k3backend.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_TOMBSTONES", 8)
    engine = make_engine(model32, tok)
    ids = [f"{i}-" + "x" * 100_000 for i in range(12)]
    for cid in ids:
        assert engine.stop(cid) == 0
    assert len(engine._tombstones) == 8 and all(len(k) == 16 for k in engine._tombstones)
    assert not engine._take_tombstone(ids[0]) and not engine._take_tombstone(ids[3])  # the oldest four: gone
    assert engine._take_tombstone(ids[4]) and engine._take_tombstone(ids[11])
    assert not engine._take_tombstone(ids[11])  # consumed once


def test_stop_while_being_prepared_cancels_it(model32, tok, make_engine, greedy_ref):
    """A stop that lands while the request is still being tokenized finds it ([CAN-5] at every interleaving)."""
    req, _ = greedy_ref
    engine = make_engine(model32, tok)
    entered, release, col = threading.Event(), threading.Event(), Collector()

    def prepare() -> Request:
        entered.set()
        release.wait(WAIT_S)
        return long_request(req)

    engine.add("g", prepare, col)
    assert entered.wait(WAIT_S)
    assert engine.stop("g") == 1
    release.set()
    out = check_events(col.wait("g")["g"])
    assert (out.finish_reason, out.token_ids, out.error) == (FinishReason.CANCELLED, [], None)
    assert engine.stats().steps == 0
    assert_idle(engine)


# ---- admission errors, failure, shutdown -------------------------------------------------------

def test_full_queue_is_unavailable(model32, tok, make_engine, greedy_ref):
    req, _ = greedy_ref
    engine = make_engine(model32, tok, max_num_seqs=1, max_queued_requests=1)
    col, entered, gate = Collector(), threading.Event(), threading.Event()
    col.hook = lambda out: (entered.set(), gate.wait(WAIT_S))  # park the output thread inside a callback
    a = engine.submit(long_request(req, "a"), col)
    assert entered.wait(WAIT_S)
    b = engine.submit(long_request(req, "b"), col)
    with pytest.raises(Unavailable, match=r"request queue is full \(1 waiting, max_queued_requests 1\)"):
        engine.submit(long_request(req, "c"), col)
    engine.abort(a)
    engine.abort(b)
    gate.set()
    col.wait("a", "b")
    assert_idle(engine)


def test_invalid_requests_end_with_invalid_arg(model32, tok, make_engine):
    """Checks that need the prepared request run on the admission thread: the error is the final event."""
    engine, col = make_engine(model32, tok), Collector()
    ok = SamplingParams(max_tokens=4)
    cases = {
        "long": (Request("long", [65] * 1000, SamplingParams(max_tokens=100)),
                 r"^prompt \(1000 tokens\) \+ max_tokens \(100\) exceeds max_model_len 1024$"),
        "no_room": (Request("no_room", [65] * 1024, SamplingParams(max_tokens=1)),
                    r"^prompt \(1024 tokens\) leaves no room for output within max_model_len 1024$"),
        "empty": (Request("empty", [], ok), "prompt is empty"),
        "vocab": (Request("vocab", [65, 512], ok), "token id 512 is outside the vocabulary 0..511"),
        "pads": (Request("pads", [tok.media_pad_id] * 2, ok, image_embeds=torch.zeros(1, 64)),
                 "2 image pad positions but image_embeds has 1 rows"),
        "stop": (Request("stop", [65], replace(ok, stop=("",))), "stop strings must be non-empty"),
    }
    for req, _ in cases.values():
        engine.submit(req, col)
    for rid, (_, message) in cases.items():
        out = check_events(col.wait(rid)[rid])
        assert out.finish_reason is FinishReason.ERROR and isinstance(out.error, InvalidArgument), rid
        assert re.search(message, str(out.error)), (rid, out.error)
    assert engine.stats().steps == 0
    assert_idle(engine)


def test_model_error_fails_in_flight_requests_and_marks_unhealthy(model32, tok, make_engine, greedy_ref, monkeypatch):
    req, _ = greedy_ref
    engine = make_engine(model32, tok)
    lm, calls = model32.language_model, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected fault")
        return type(lm).forward(lm, *args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)
    cols = [Collector(), Collector()]
    for i, col in enumerate(cols):
        engine.submit(long_request(req, f"r{i}"), col)
    for i, col in enumerate(cols):
        final = check_events(col.wait(f"r{i}")[f"r{i}"])
        assert final.finish_reason is FinishReason.ERROR and isinstance(final.error, Unavailable)
        assert str(final.error) == "engine failed: engine step failed: RuntimeError: injected fault"
    assert not engine.is_healthy() and not engine.stats().healthy
    with pytest.raises(Unavailable, match=r"engine is not healthy \(engine step failed: RuntimeError"):
        engine.submit(req, Collector())


def test_raising_callback_does_not_stop_the_engine(model32, tok, make_engine, greedy_ref):
    req, ref = greedy_ref
    engine = make_engine(model32, tok)
    col = Collector()

    def hook(out: RequestOutput) -> None:
        raise ValueError("client bug")

    col.hook = hook
    engine.submit(req, col)
    assert check_events(col.wait("g")["g"]).token_ids == ref
    assert engine.is_healthy()


def test_close_fails_in_flight_requests_and_is_idempotent(model32, tok, greedy_ref):
    req, _ = greedy_ref
    engine = new_engine(model32, tok, max_num_seqs=1)
    col, started = Collector(), threading.Event()
    col.hook = lambda out: started.set()
    engine.submit(long_request(req, "a"), col)
    engine.submit(long_request(req, "b"), col)  # still queued
    assert started.wait(WAIT_S)
    engine.close()
    for rid in ("a", "b"):
        final = check_events(col.events[rid])
        assert (final.finish_reason, str(final.error)) == (FinishReason.ERROR, "server shutting down")
    assert not any(t.is_alive() for t in engine._threads)
    engine.close()
    with pytest.raises(Unavailable, match="server shutting down"):
        engine.submit(req, col)


def test_stuck_step_fails_its_requests_and_the_engine(model32, tok, greedy_ref, monkeypatch):
    """[HLT-7]: a step past step_timeout_s fails the engine and its requests within the watchdog period."""
    req, _ = greedy_ref
    engine = new_engine(model32, tok, step_timeout_s=0.05)
    lm, entered, release = model32.language_model, threading.Event(), threading.Event()

    def forward(*args, **kwargs):
        entered.set()
        release.wait(WAIT_S)
        return type(lm).forward(lm, *args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)
    col = Collector()
    engine.submit(req, col)
    assert entered.wait(WAIT_S)
    final = check_events(col.wait("g")["g"])  # while the step is still stuck
    assert final.finish_reason is FinishReason.ERROR and isinstance(final.error, Unavailable)
    assert "made no progress" in str(final.error)
    assert not engine.is_healthy() and "made no progress" in engine.stats().unhealthy_reason
    with pytest.raises(Unavailable, match="engine is not healthy"):
        engine.submit(req, Collector())
    release.set()
    engine.close(timeout=WAIT_S)
    assert not any(t.is_alive() for t in engine._threads)
    assert len(col.events["g"]) == 1  # the loop sent nothing after the watchdog answered for it


def test_close_drains_then_cuts(model32, tok, greedy_ref):
    """[HLT-9]: close(drain_s) lets a short request finish and ends a long one with UNAVAILABLE."""
    req, ref = greedy_ref
    engine = new_engine(model32, tok, max_model_len=4096)
    col = Collector()
    engine.submit(req, col)  # 24 tokens
    engine.submit(replace(req, request_id="long", params=replace(req.params, max_tokens=3000)), col)
    engine.close(timeout=WAIT_S, drain_s=3.0)
    assert check_events(col.events["g"]).token_ids == ref
    final = check_events(col.events["long"])
    assert final.finish_reason is FinishReason.ERROR and str(final.error) == "server shutting down"
    assert 0 < len(final.token_ids) < 3000
