"""serving.responses: engine events -> output tensors (SERVING.md §2.3, §5.6-5.10) and error messages (§7)."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest

from k3backend.engine.request import FinishReason, TokenLogprob
from k3backend.serving.responses import RequestOutput
from k3backend.errors import Cancelled, InvalidArgument, K3Error, Unavailable, Unsupported
from k3backend.serving.params import OutputOptions, ParsedRequest
from k3backend.serving.responses import ResponseBuilder, error_message, stop_request_response
from k3backend.tokenizer import Tokenizer, write_tiny_tokenizer

ALL_OUTPUTS = dict(return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
                   return_log_probs=True, return_cumulative_logprob=True, return_logprobs=True,
                   return_reasoning=True, return_perf_metrics=True)
# Deltas as the engine would send them: visible text, a held-back token (no text), a 2-token chunk.
DELTAS = [("Hel", [72, 101, 108]), ("", [108]), ("lo", [111]), (" wo", [32, 119]), ("", [111]),
          ("rld", [114, 108, 100])]
FINAL = ("", [258])  # EOS: no text ([STP-2])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


def parsed(**flags) -> ParsedRequest:
    return ParsedRequest(request_id="r1", text_input="Say:", outputs=OutputOptions(**flags), arrival_time=1000.0)


def event(text: str = "", ids: list[int] | None = None, *, finished: bool = False, reason: FinishReason | None = None,
          reasoning: str = "", logprob: float = -0.5, **extra) -> RequestOutput:
    ids = ids or []
    logprobs = [TokenLogprob(token=t, logprob=logprob, rank=2, top=[(t + 1, -0.1), (t, logprob)]) for t in ids]
    return RequestOutput(request_id="r1", text=text, reasoning=reasoning, token_ids=ids, logprobs=logprobs,
                         finished=finished, finish_reason=reason if finished else None, num_input_tokens=5, **extra)


def run(builder: ResponseBuilder, deltas=DELTAS, final=FINAL, reason=FinishReason.STOP) -> list[dict[str, np.ndarray]]:
    responses = [builder.on_event(event(text, ids)) for text, ids in deltas]
    responses.append(builder.on_event(event(*final, finished=True, reason=reason)))
    return [r for r in responses if r is not None]


def text_of(response: dict[str, np.ndarray], name: str = "text_output") -> str:
    arr = response[name]
    assert arr.shape == (1, 1) and arr.dtype == object and isinstance(arr[0, 0], bytes)
    return arr[0, 0].decode("utf-8")


def scalar(response: dict[str, np.ndarray], name: str, dtype: type) -> float | int:
    arr = response[name]
    assert arr.shape == (1, 1) and arr.dtype == dtype, (name, arr.shape, arr.dtype)
    return arr[0, 0].item()


# ---- the response protocol ([STR-1]..[STR-4], [STR-8]) -------------------------------------------


def test_STR1_non_streaming_sends_one_response_on_the_final_event():
    builder = ResponseBuilder(parsed(return_num_output_tokens=True, return_finish_reason=True))
    assert all(builder.on_event(event(text, ids)) is None for text, ids in DELTAS)
    final = builder.on_event(event(*FINAL, finished=True, reason=FinishReason.LENGTH))
    assert text_of(final) == "Hello world" and builder.finished
    assert scalar(final, "num_output_tokens", np.int32) == 12  # the EOS token counts ([TOK-2])
    assert text_of(final, "finish_reason") == "length"


def random_deltas(rng: random.Random, text: str) -> list[tuple[str, list[int]]]:
    """`text` cut at random points, with held-back (empty) events mixed in."""
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(len(text) // 2)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas = []
    for piece in pieces:
        deltas += [("", [1])] * rng.randrange(3) + [(piece, [ord(c) for c in piece])]
    return deltas


@pytest.mark.parametrize("seed", range(10))
def test_STR4_streamed_deltas_join_to_the_non_streamed_text(seed: int):
    deltas = random_deltas(random.Random(seed), "Hello, wörld! 🙂 end")
    [full] = run(ResponseBuilder(parsed()), deltas=deltas)
    stream = run(ResponseBuilder(parsed(stream=True)), deltas=deltas)
    assert "".join(text_of(r) for r in stream) == text_of(full) == "Hello, wörld! 🙂 end"


def test_STR3_empty_non_final_events_are_merged_into_the_next_response():
    builder = ResponseBuilder(parsed(stream=True, return_num_output_tokens=True, return_log_probs=True))
    assert builder.on_event(event("", [1, 2])) is None  # never an empty first chunk
    response = builder.on_event(event("a", [3], logprob=-1.0))
    assert text_of(response) == "a"
    assert scalar(response, "num_output_tokens", np.int32) == 3  # the held tokens travel with it ([STR-8])
    assert response["output_log_probs"].tolist() == [[[-0.5, -0.5, -1.0]]]


def test_STR3_every_non_final_response_has_text_and_the_final_may_be_empty():
    stream = run(ResponseBuilder(parsed(stream=True, return_num_output_tokens=True)))
    assert all(text_of(r) for r in stream[:-1])
    assert text_of(stream[-1]) == "" and scalar(stream[-1], "num_output_tokens", np.int32) == 1
    assert len(stream) == 5  # 4 deltas with text + the final


def test_STR3_reasoning_text_alone_makes_a_response():
    builder = ResponseBuilder(parsed(stream=True, return_reasoning=True))
    response = builder.on_event(event(reasoning="hmm", ids=[1]))
    assert text_of(response) == "" and text_of(response, "reasoning_output") == "hmm"


def test_TOK2_num_output_tokens_sum_to_the_total_and_input_tokens_repeat():
    stream = run(ResponseBuilder(parsed(stream=True, return_num_output_tokens=True, return_num_input_tokens=True)))
    assert sum(scalar(r, "num_output_tokens", np.int32) for r in stream) == 12
    assert {scalar(r, "num_input_tokens", np.int32) for r in stream} == {5}


def test_TOK1_num_input_tokens_from_the_builder_when_events_carry_none():
    builder = ResponseBuilder(parsed(return_num_input_tokens=True), num_input_tokens=42)
    ev = RequestOutput(request_id="r1", text="x", token_ids=[1], finished=True, finish_reason=FinishReason.STOP)
    assert scalar(builder.on_event(ev), "num_input_tokens", np.int32) == 42


def test_STR9_event_after_the_final_one_is_a_defect():
    builder = ResponseBuilder(parsed())
    run(builder)
    with pytest.raises(RuntimeError, match="after the final one"):
        builder.on_event(event("x", [1]))


# ---- finish_reason (§5.8) ------------------------------------------------------------------------


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED])
def test_finish_reason_empty_until_the_final_response(reason: FinishReason):
    stream = run(ResponseBuilder(parsed(stream=True, return_finish_reason=True)), reason=reason)
    assert [text_of(r, "finish_reason") for r in stream] == [""] * (len(stream) - 1) + [reason.label]


def test_engine_error_event_raises_its_error():
    """A final event with an error becomes that error: the request's error response, not data (§5.8)."""
    builder = ResponseBuilder(parsed(stream=True))
    builder.on_event(event("a", [1]))
    with pytest.raises(Unavailable, match="engine failed: worker rank 3 exited"):
        builder.on_event(event(finished=True, reason=FinishReason.ERROR,
                               error=Unavailable("engine failed: worker rank 3 exited")))
    assert builder.finished


# ---- echo ([TXT-4]) ------------------------------------------------------------------------------


def test_TXT4_echo_prepended_once_to_the_first_data_response():
    builder = ResponseBuilder(parsed(stream=True, exclude_input_in_output=False), "Say:")
    assert builder.on_event(event("", [1])) is None  # the echo never forms a response of its own
    stream = [builder.on_event(event("a", [2])), builder.on_event(event("b", [3])),
              builder.on_event(event(finished=True, reason=FinishReason.STOP))]
    assert [text_of(r) for r in stream] == ["Say:a", "b", ""]


def test_TXT4_echo_in_the_only_response_and_off_by_default():
    [only] = run(ResponseBuilder(parsed(exclude_input_in_output=False), "Say:"))
    assert text_of(only) == "Say:Hello world"
    [only] = run(ResponseBuilder(parsed(), "Say:"))
    assert text_of(only) == "Hello world"


def test_TXT4_echo_in_an_otherwise_empty_final_response():
    builder = ResponseBuilder(parsed(stream=True, exclude_input_in_output=False), "Say:")
    assert text_of(builder.on_event(event(finished=True, reason=FinishReason.CANCELLED))) == "Say:"


def test_STR5_lone_surrogates_in_the_echo_become_replacement_characters():
    [only] = run(ResponseBuilder(parsed(exclude_input_in_output=False), "a\ud800b"), deltas=[])
    assert text_of(only) == "a\ufffdb"


# ---- reasoning ([TXT-3]) -------------------------------------------------------------------------


def test_TXT3_reasoning_output_only_when_asked_and_present():
    builder = ResponseBuilder(parsed(return_reasoning=True))
    builder.on_event(event(reasoning="think ", ids=[1]))
    final = builder.on_event(event("answer", [2], finished=True, reason=FinishReason.STOP))
    assert text_of(final) == "answer" and text_of(final, "reasoning_output") == "think "
    [only] = run(ResponseBuilder(parsed(return_reasoning=True)))
    assert "reasoning_output" not in only


def test_TXT3_reasoning_stays_in_text_output_when_not_asked():
    builder = ResponseBuilder(parsed())
    builder.on_event(event(reasoning="think ", ids=[1]))
    final = builder.on_event(event("answer", [2], finished=True, reason=FinishReason.STOP))
    assert text_of(final) == "think answer" and "reasoning_output" not in final


# ---- OUT-1 and the output table (§2.3) ------------------------------------------------------------


def test_OUT1_only_text_output_when_nothing_else_is_asked():
    for response in run(ResponseBuilder(parsed(stream=True))):
        assert set(response) == {"text_output"}


@pytest.mark.parametrize("flag, names", [
    ("return_finish_reason", {"finish_reason"}),
    ("return_num_input_tokens", {"num_input_tokens"}),
    ("return_num_output_tokens", {"num_output_tokens"}),
    ("return_log_probs", {"cum_log_probs", "output_log_probs"}),
    ("return_cumulative_logprob", {"cumulative_logprob"}),
    ("return_logprobs", {"logprobs"}),
    ("return_perf_metrics", {"num_cached_tokens", "arrival_time_ns", "first_scheduled_time_ns",
                             "first_token_time_ns", "last_token_time_ns"}),
])
def test_OUT1_each_flag_adds_exactly_its_outputs(tok: Tokenizer, flag: str, names: set[str]):
    for response in run(ResponseBuilder(parsed(stream=True, **{flag: True}), tokenizer=tok)):
        assert set(response) == {"text_output"} | names


def test_section_2_3_dtypes_and_shapes(tok: Tokenizer):
    builder = ResponseBuilder(parsed(stream=True, top_logprobs=1, **ALL_OUTPUTS), tokenizer=tok)
    ev = event("ab", [97, 98], reasoning="r", num_cached_tokens=3, arrival_time_ns=11, first_scheduled_time_ns=12,
               first_token_time_ns=13, last_token_time_ns=14)
    response = builder.on_event(ev)
    for name in ("text_output", "reasoning_output", "finish_reason", "logprobs"):
        text_of(response, name)
    assert scalar(response, "num_input_tokens", np.int32) == 5
    assert scalar(response, "num_output_tokens", np.int32) == 2
    assert scalar(response, "num_cached_tokens", np.int32) == 3
    assert scalar(response, "cum_log_probs", np.float32) == -1.0
    assert scalar(response, "cumulative_logprob", np.float32) == -1.0
    assert response["output_log_probs"].shape == (1, 1, 2) and response["output_log_probs"].dtype == np.float32
    times = [scalar(response, n, np.int64) for n in
             ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
    assert times == [11, 12, 13, 14]


def test_perf_metrics_arrival_defaults_to_the_parse_time():
    builder = ResponseBuilder(parsed(return_perf_metrics=True))
    final = builder.on_event(event("x", [1], finished=True, reason=FinishReason.STOP))
    assert scalar(final, "arrival_time_ns", np.int64) == 1000 * 10**9
    assert scalar(final, "first_token_time_ns", np.int64) == 0


def test_perf_metrics_keep_the_first_token_time_across_streamed_responses():
    """Each engine event carries its own delta's times; the final response must still say when the
    request's first token was sampled (it said the last delta's, seen as a negative first-response leg
    in bench/openai_overhead.py on the H200)."""
    builder = ResponseBuilder(parsed(stream=True, return_perf_metrics=True))
    builder.on_event(event("a", [97], first_scheduled_time_ns=12, first_token_time_ns=13, last_token_time_ns=13))
    builder.on_event(event("b", [98], first_token_time_ns=20, last_token_time_ns=20))
    final = builder.on_event(event("c", [99], finished=True, reason=FinishReason.LENGTH, first_token_time_ns=30,
                                   last_token_time_ns=30))
    times = [scalar(final, n, np.int64) for n in ("first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
    assert times == [12, 13, 30]


# ---- log-probabilities ([LP-2], [LP-3]) ----------------------------------------------------------


def test_LP2_cumulative_sum_and_per_response_values():
    stream = run(ResponseBuilder(parsed(stream=True, return_log_probs=True, return_cumulative_logprob=True)))
    per_response = [r["output_log_probs"][0, 0].tolist() for r in stream]
    assert [len(v) for v in per_response] == [3, 2, 2, 4, 1]
    running = np.cumsum([sum(v) for v in per_response])
    assert [scalar(r, "cum_log_probs", np.float32) for r in stream] == pytest.approx(running.tolist())
    assert all(r["cum_log_probs"][0, 0] == r["cumulative_logprob"][0, 0] for r in stream)
    assert scalar(stream[-1], "cum_log_probs", np.float32) == pytest.approx(-0.5 * 12)


def test_LP2_final_response_covering_zero_tokens():
    builder = ResponseBuilder(parsed(stream=True, return_log_probs=True))
    builder.on_event(event("a", [1]))
    final = builder.on_event(event(finished=True, reason=FinishReason.CANCELLED))
    assert final["output_log_probs"].shape == (1, 1, 0) and scalar(final, "cum_log_probs", np.float32) == -0.5


def test_LP3_logprobs_json_format(tok: Tokenizer):
    builder = ResponseBuilder(parsed(return_logprobs=True, top_logprobs=2), tokenizer=tok)
    lps = [TokenLogprob(token=0xC3, logprob=-0.25, rank=1, top=[(0xC3, -0.25), (97, -2.0), (98, -3.0)]),
           TokenLogprob(token=258, logprob=float("-inf"), rank=7, top=[(97, -0.1), (98, -0.2)])]
    ev = RequestOutput(request_id="r1", token_ids=[0xC3, 258], logprobs=lps, finished=True,
                       finish_reason=FinishReason.STOP)
    entries = json.loads(text_of(builder.on_event(ev), "logprobs"))
    assert entries == [
        {"195": {"logprob": -0.25, "rank": 1, "decoded_token": "\ufffd"},  # sampled and top overlap
         "97": {"logprob": -2.0, "rank": 2, "decoded_token": "a"}},
        {"258": {"logprob": -9999.0, "rank": 7, "decoded_token": "<|end_of_msg|>"},
         "97": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
         "98": {"logprob": -0.2, "rank": 2, "decoded_token": "b"}},
    ]
    assert list(entries[1]) == ["258", "97", "98"]  # sampled token first


def test_LP3_logprobs_json_covers_the_tokens_of_each_response(tok: Tokenizer):
    stream = run(ResponseBuilder(parsed(stream=True, return_logprobs=True), tokenizer=tok))
    lengths = [len(json.loads(text_of(r, "logprobs"))) for r in stream]
    assert lengths == [3, 2, 2, 4, 1]
    assert all(len(entry) == 1 for r in stream for entry in json.loads(text_of(r, "logprobs")))  # top_logprobs 0


def test_LP3_return_logprobs_needs_the_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        ResponseBuilder(parsed(return_logprobs=True))


def test_missing_engine_logprobs_is_a_defect():
    builder = ResponseBuilder(parsed(return_log_probs=True))
    with pytest.raises(RuntimeError, match="2 tokens but logprobs None"):
        builder.on_event(RequestOutput(request_id="r1", text="x", token_ids=[1, 2]))


# ---- stop requests and errors ([CAN-4], [ERR-1], [ERR-3]) ----------------------------------------


def test_CAN4_stop_request_response_is_an_empty_text_output():
    response = stop_request_response()
    assert set(response) == {"text_output"} and text_of(response) == ""


@pytest.mark.parametrize("exc, code, message", [
    (InvalidArgument("top_p must be in (0, 1], got 1.5"), "INVALID_ARG",
     "k3_lm: INVALID_ARG: top_p must be in (0, 1], got 1.5"),
    (Unsupported("beam_width > 1 is not supported"), "UNSUPPORTED", "k3_lm: UNSUPPORTED: beam_width > 1 is not supported"),
    (Unavailable("engine is not healthy"), "UNAVAILABLE", "k3_lm: UNAVAILABLE: engine is not healthy"),
    (Cancelled("request cancelled by client"), "CANCELLED", "k3_lm: CANCELLED: request cancelled by client"),
])
def test_ERR1_message_names_model_and_code(exc: Exception, code: str, message: str):
    assert error_message("k3_lm", exc, "abc") == (code, message)


@pytest.mark.parametrize("exc", [KeyError("boom"), ValueError("secret detail"), K3Error("base class")])
def test_ERR3_unexpected_errors_are_internal_and_logged(caplog: pytest.LogCaptureFixture, exc: Exception):
    with caplog.at_level(logging.ERROR, logger="k3backend.serving.responses"):
        code, message = error_message("k3_lm", exc, "abc")
    assert (code, message) == ("INTERNAL", "k3_lm: INTERNAL: unexpected error (see server log, request id 'abc')")
    [record] = caplog.records
    assert record.exc_info is not None and "'abc'" in record.getMessage()
