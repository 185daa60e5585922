"""RequestStream and the request registry: engine ids -> text, stops and cancellation, one response
per batch of steps (SERVING.md §5.5-5.9, §6; ENGINE.md §8).

The tiny byte-level tokenizer makes the engine's side easy to play: token id b is byte b, so a
test feeds the tokens of any text it likes, one engine step at a time, and checks the responses a
client would get. The real engine drives the same streams in the server tests.
"""

from __future__ import annotations

import pytest

from k3backend.engine.request import FinishReason, TokenLogprob
from k3backend.errors import Cancelled, InvalidArgument, Unavailable
from k3backend.serving import registry as registry_module
from k3backend.serving.registry import Registry
from k3backend.serving.stream import Cancel, RequestStream
from test_serving_params import EOS, parse, sp, tok  # noqa: F401 - tok is a fixture

T = 1_000_000_000  # a step's wall clock


def stream(tok, **inputs) -> RequestStream:
    s = RequestStream("c1", None, parse(**inputs), tok)
    s.prepare(eos_ids=EOS, max_model_len=4096, default_max_tokens=16)
    return s


def ids(text: str) -> list[int]:
    return list(text.encode())


def play(s: RequestStream, tokens: list[int], per_response: int = 1, last: FinishReason = FinishReason.NONE,
         logprobs: bool = False) -> tuple[list[dict], list[bool]]:
    """Feed `tokens` one step each, taking a response after every `per_response` steps; `last` is
    the engine's finish code on the last token. Returns the responses and what each on_token said."""
    out, stopped = [], []
    for i, t in enumerate(tokens):
        lp = TokenLogprob(t, -0.5, 1, [(t, -0.5)]) if logprobs else None
        stopped.append(s.on_token(t, lp, last if i == len(tokens) - 1 else FinishReason.NONE, T + i))
        if (i + 1) % per_response == 0 or i == len(tokens) - 1:
            r = s.take_response()
            if r is not None:
                assert r[1] is None, r
                out.append(r[0])
    return out, stopped


def text(responses: list[dict]) -> str:
    return "".join(r["text_output"].reshape(-1)[0].decode() for r in responses)


def total(responses: list[dict], name: str) -> int:
    return sum(int(r[name].reshape(-1)[0]) for r in responses)


STREAM = {"stream": True, "return_finish_reason": True, "return_num_output_tokens": True}


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_ends_stop_and_drops_later_tokens(tok, include):
    """[STP-3]: the token completing the match is the last one counted; tokens the engine sampled
    before it learnt of the stop are neither sent nor counted; on_token says when to abort."""
    s = stream(tok, text_input="x", max_tokens=64, stop_words=["world"],
               sampling_parameters=sp(include_stop_str_in_output=include), **STREAM)
    responses, stopped = play(s, ids("Hello, world! and more"))
    n = len("Hello, world")
    assert stopped.index(True) == n - 1 and stopped.count(True) == 1
    assert text(responses) == "Hello, " + ("world" if include else "")
    assert total(responses, "num_output_tokens") == n == s.num_tokens
    assert responses[-1]["finish_reason"].reshape(-1)[0] == b"stop" and s.done


def test_min_tokens_suspends_stop_strings(tok):
    s = stream(tok, text_input="x", max_tokens=64, min_tokens=10, stop_words=["ab"], **STREAM)
    responses, stopped = play(s, ids("ab ab abcd ab tail"))
    assert stopped.index(True) == len("ab ab abcd ab") - 1  # the first match completed by token 10 or later
    assert text(responses) == "ab ab abcd "


def test_a_stop_id_token_has_no_text_and_length_keeps_its_text(tok):
    s = stream(tok, text_input="x", max_tokens=64, **STREAM)
    responses, _ = play(s, ids("abc!"), last=FinishReason.STOP)  # "!" stands for the EOS the engine stopped on
    assert text(responses) == "abc" and total(responses, "num_output_tokens") == 4
    s = stream(tok, text_input="x", max_tokens=4, **STREAM)
    responses, _ = play(s, ids("abc!"), last=FinishReason.LENGTH)
    assert text(responses) == "abc!" and responses[-1]["finish_reason"].reshape(-1)[0] == b"length"


@pytest.mark.parametrize("per_response", [1, 2, 5, 100])
def test_a_response_covers_every_token_since_the_previous_one(tok, per_response):
    """Coalescing ([STR-4], [STR-8]): when sending falls behind, one response carries all the tokens
    that arrived meanwhile, in order, none lost; texts, counts and log-probs join up the same."""
    words = "Grüße aus Köln, 東京 and back"  # multi-byte characters split over tokens
    s = stream(tok, text_input="x", max_tokens=64, return_log_probs=True, **STREAM)
    responses, _ = play(s, ids(words), per_response, last=FinishReason.LENGTH, logprobs=True)
    assert text(responses) == words
    assert total(responses, "num_output_tokens") == len(words.encode())
    assert sum(r["output_log_probs"].size for r in responses) == len(words.encode())
    assert len(responses) <= -(-len(words.encode()) // per_response)  # at most one per batch of steps
    if per_response > 1:
        assert max(int(r["num_output_tokens"].reshape(-1)[0]) for r in responses) > 1


def test_non_streaming_answers_once_with_everything(tok):
    s = stream(tok, text_input="x", max_tokens=64, return_finish_reason=True, return_num_output_tokens=True)
    responses, _ = play(s, ids("one two"), last=FinishReason.LENGTH)
    assert len(responses) == 1 and text(responses) == "one two" and total(responses, "num_output_tokens") == 7


def test_a_stop_request_flushes_held_text(tok):
    """[CAN-5]: the stop lands while "a" is held back as a possible start of "ab": the final has it."""
    s = stream(tok, text_input="x", max_tokens=64, stop_words=["ab"], **STREAM)
    responses, _ = play(s, ids("xya"))
    assert text(responses) == "xy"
    s.cancel = Cancel.STOP
    s.on_end(FinishReason.CANCELLED, None)
    final = s.take_response()
    assert final[2] and final[0]["text_output"].reshape(-1)[0] == b"a"
    assert final[0]["finish_reason"].reshape(-1)[0] == b"cancelled"


def test_an_abort_ends_with_a_cancelled_error_and_an_engine_error_keeps_its_code(tok):
    s = stream(tok, text_input="x", max_tokens=64, **STREAM)
    play(s, ids("ab"))
    s.cancel = Cancel.ABORT
    s.on_end(FinishReason.CANCELLED, None)
    outputs, error, final = s.take_response()
    assert outputs is None and isinstance(error, Cancelled) and final
    assert s.take_response() is None  # nothing after the final
    s = stream(tok, text_input="x", max_tokens=64, **STREAM)
    s.on_end(FinishReason.ERROR, ("INVALID_ARG", "prompt is empty"))
    _, error, _ = s.take_response()
    assert isinstance(error, InvalidArgument) and str(error) == "prompt is empty"


def test_a_stream_ended_here_ignores_the_engines_later_news(tok):
    s = stream(tok, text_input="x", max_tokens=64, **STREAM)
    s.fail(Unavailable("server shutting down"))
    assert s.on_token(65, None, FinishReason.NONE, T) is False
    s.on_end(FinishReason.CANCELLED, None)
    _, error, final = s.take_response()
    assert isinstance(error, Unavailable) and final and s.num_tokens == 0


def test_cancelled_before_the_engine_saw_it(tok):
    s = RequestStream("c1", None, parse(text_input="x", **STREAM), tok)  # never prepared
    s.cancel_now(Cancel.STOP)
    outputs, error, final = s.take_response()
    assert error is None and final and outputs["finish_reason"].reshape(-1)[0] == b"cancelled"
    s = RequestStream("c1", None, parse(text_input="x", **STREAM), tok)
    s.cancel_now(Cancel.ABORT)
    assert isinstance(s.take_response()[1], Cancelled)


def test_reasoning_goes_to_reasoning_output_when_asked(tok):
    s = stream(tok, text_input="q<|open|>think<|sep|>", max_tokens=64, return_reasoning=True, **STREAM)
    think = ids("hmm") + [tok.id_of("<|close|>")] + ids("think") + [tok.id_of("<|sep|>")] + ids("42")
    responses, _ = play(s, think, last=FinishReason.LENGTH)
    assert text(responses) == "42"
    assert "".join(r["reasoning_output"].reshape(-1)[0].decode() for r in responses if "reasoning_output" in r) == "hmm"


def test_an_empty_stop_string_is_refused_when_prepared(tok):
    s = RequestStream("c1", None, parse(text_input="x", max_tokens=4), tok)
    s.parsed.sampling.__dict__["stop"] = ("",)  # past the parser's own check: the detokenizer refuses it too
    with pytest.raises(InvalidArgument, match="stop strings must be non-empty"):
        s.prepare(eos_ids=EOS, max_model_len=4096, default_max_tokens=16)


# ---- the registry ([CAN-5], [CAN-7]) --------------------------------------------------------------

def test_a_stop_finds_its_target_at_every_stage(tok):
    reg = Registry(tombstone_ttl_s=30)
    preparing, running, other = (RequestStream(cid, None, parse(text_input="x"), tok) for cid in ("g", "g", "h"))
    for s in (preparing, running, other):
        assert reg.open(s)
    with reg.lock:
        reg.bind(running, 7)
    assert reg.stop("g") == [running]  # the one the engine runs is returned, to be aborted there
    assert preparing.cancel is running.cancel is Cancel.STOP and other.cancel is None
    assert reg.by_rid(7) is running and len(reg) == 3
    reg.forget(running)
    assert reg.by_rid(7) is None and len(reg) == 2


def test_an_unmatched_stop_leaves_a_tombstone_consumed_once(tok):
    reg = Registry(tombstone_ttl_s=30)
    assert reg.stop("g") == []
    assert not reg.open(RequestStream("g", None, parse(text_input="x"), tok))  # cancelled at once
    assert reg.open(RequestStream("g", None, parse(text_input="x"), tok))
    off = Registry(tombstone_ttl_s=0)
    off.stop("g")
    assert off.open(RequestStream("g", None, parse(text_input="x"), tok))


def test_unmatched_stops_are_bounded_in_count_and_bytes(tok, monkeypatch):
    """Tombstones are client-chosen ids: a flood of long unmatched stop ids keeps at most
    MAX_TOMBSTONES digests of 16 bytes, the oldest dropped first, and each still works until then."""
    monkeypatch.setattr(registry_module, "MAX_TOMBSTONES", 8)
    reg = Registry(tombstone_ttl_s=30)
    cids = [f"{i}-" + "x" * 100_000 for i in range(12)]
    for cid in cids:
        reg.stop(cid)
    assert len(reg._tombstones) == 8 and all(len(k) == 16 for k in reg._tombstones)
    assert not reg._take_tombstone(cids[0]) and not reg._take_tombstone(cids[3])  # the oldest four: gone
    assert reg._take_tombstone(cids[4]) and reg._take_tombstone(cids[11])
    assert not reg._take_tombstone(cids[11])  # consumed once


def test_a_full_queue_closing_or_failed_registry_is_unavailable(tok):
    reg = Registry(tombstone_ttl_s=30, max_queued=1)
    assert reg.open(RequestStream("a", None, parse(text_input="x"), tok))
    with pytest.raises(Unavailable, match=r"request queue is full \(1 waiting, max_queued_requests 1\)"):
        reg.open(RequestStream("b", None, parse(text_input="x"), tok))
    reg.failure = "worker rank 1 pid 9 exited (signal 9)"
    with pytest.raises(Unavailable, match=r"engine is not healthy \(engine failed: worker rank 1"):
        reg.open(RequestStream("c", None, parse(text_input="x"), tok))
    reg.closing = True
    with pytest.raises(Unavailable, match="server shutting down"):
        reg.open(RequestStream("c", None, parse(text_input="x"), tok))
