"""The gateway's pure parts (no server): OpenAI bodies -> k3 inputs, and Triton errors -> HTTP statuses."""

from __future__ import annotations

import json
import struct

import pytest

from k3backend.openai.errors import ApiError, from_triton
from k3backend.openai.options import workers
from k3backend.openai.translate import chat_plan, completion_plan
from k3backend.openai.responses import Answer
from k3backend.openai.triton import Delta, parse_delta, request_pb


@pytest.mark.parametrize("message,status", [
    ("in ensemble 'k3_ensemble', k3_lm: INVALID_ARG: top_p must be in (0, 1], got 1.5", 400),
    ("k3_lm: UNSUPPORTED: beam_width > 1 is not supported", 400),
    ("k3_lm: UNAVAILABLE: request queue is full (8 waiting, max_queued_requests 8)", 429),
    ("k3_lm: UNAVAILABLE: server shutting down", 503),
    ("k3_lm: UNAVAILABLE: engine is not healthy (engine step made no progress for 301 s (step_timeout_s 300))", 503),
    ("k3_vision: UNAVAILABLE: image 0: fetching https://example.invalid/a.png timed out", 503),
    ("Request for unknown model: 'k3_ensemble' has no available versions", 503),
    ("k3_lm: INTERNAL: unexpected error (see server log, request id 'abc')", 500),
    ("unexpected inference input 'temprature' for model 'k3_ensemble'", 500),  # the gateway sent it: a defect
], ids=["invalid", "unsupported", "queue-full", "shutdown", "unhealthy", "fetch", "not-loaded", "internal", "core"])
def test_triton_error_codes_map_to_http_statuses(message, status):
    e = from_triton(message)
    assert e.status == status and message in e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_messages_become_k3_messages():
    body = {"model": "k3", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "high"}}]},
        {"role": "assistant", "content": "A cat.", "refusal": None, "audio": None}],
        "thinking": True, "max_completion_tokens": 7, "max_tokens": 99}
    (job,) = chat_plan(body, "k3").jobs
    assert json.loads(job.inputs["messages"][0]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "assistant", "content": "A cat."}]
    assert job.inputs["chat_template_kwargs"] == ('{"thinking": true}', "BYTES")
    assert job.inputs["max_tokens"] == (7, "INT32")  # max_completion_tokens wins
    assert job.inputs["text_input"] == ("", "BYTES")


@pytest.mark.parametrize("content, text_only", [
    ("hi", True), (None, True), ([{"type": "text", "text": "hi"}], True), ([], True),
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}], False),
    ([{"type": "image", "image": "x"}], False), (["hi"], False), (7, False),
])
def test_only_text_messages_may_skip_the_ensemble(content, text_only):
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}]}
    assert chat_plan(body, "k3").jobs[0].text_only is text_only


def test_malformed_messages_go_through_the_ensemble_and_completions_do_not():
    assert chat_plan({"messages": ["not a message"]}, "k3").jobs[0].text_only is False
    assert all(j.text_only for j in completion_plan({"prompt": ["a", "b"]}, "k3").jobs)


def test_n_and_prompts_fan_out_with_a_seed_per_choice():
    plan = completion_plan({"prompt": ["a", "b"], "n": 2, "seed": 2**64 - 1, "stop": "x"}, "k3")
    assert [(j.index, j.prompt_index) for j in plan.jobs] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [j.inputs["seed"][0] for j in plan.jobs] == [2**64 - 1, 0, 2**64 - 1, 0]
    assert [j.inputs["text_input"][0] for j in plan.jobs] == ["a", "a", "b", "b"]
    assert plan.jobs[0].inputs["stop_words"] == (["x"], "BYTES")
    assert len({j.request_id for j in plan.jobs}) == 4


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "a", "model": "other"}, 404, "model"),
    ({"prompt": [1, 2, 3]}, 400, "prompt"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, 400, "echo"),
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "suffix": "z"}, 400, "suffix"),
    ({"prompt": "a", "seed": -1}, 400, "seed"),
    ({"prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"prompt": "a", "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias"),
], ids=["model", "token-ids", "echo-logprobs", "best_of", "suffix", "seed", "bool", "stream_options", "logit_bias"])
def test_what_the_gateway_refuses_itself(body, status, param):
    with pytest.raises(ApiError) as e:
        completion_plan(body, "k3")
    assert (e.value.status, e.value.param) == (status, param)


def test_accepted_off_values_and_ignored_fields_change_nothing():
    plain = completion_plan({"prompt": "a"}, "k3").jobs[0].inputs
    noisy = completion_plan({"prompt": "a", "logit_bias": {}, "best_of": 1, "suffix": None, "user": "u",
                             "metadata": {"k": "v"}}, "k3").jobs[0].inputs
    assert plain == noisy


def test_request_and_response_wire_forms():
    req = request_pb("k3_ensemble", "r1", {"text_input": ("hé", "BYTES"), "max_tokens": (5, "INT32"),
                                           "stop_words": (["a", "bc"], "BYTES"), "seed": (2**63, "UINT64"),
                                           "ignore_eos": (True, "BOOL"), "top_p": (0.5, "FP32")})
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs][2] == ("stop_words", "BYTES", [1, 2])
    assert req.raw_input_contents[0] == struct.pack("<i", 3) + "hé".encode()
    assert req.raw_input_contents[2] == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"
    assert struct.unpack("<Q", req.raw_input_contents[3]) == (2**63,)
    assert req.raw_input_contents[4:] == [b"\x01", struct.pack("<f", 0.5)]

    from tritonclient.grpc import service_pb2

    resp = service_pb2.ModelInferResponse()
    for name, dtype, raw in (("text_output", "BYTES", struct.pack("<i", 2) + b"ok"),
                             ("num_output_tokens", "INT32", struct.pack("<i", 3)),
                             ("arrival_time_ns", "INT64", struct.pack("<q", 7)),
                             ("logprobs", "BYTES", struct.pack("<i", 2) + b"[]")):
        resp.outputs.add(name=name, datatype=dtype, shape=[1, 1])
        resp.raw_output_contents.append(raw)
    resp.parameters["triton_final_response"].bool_param = True
    d = parse_delta(resp)
    assert (d.text, d.n_tokens, d.logprobs, d.final, d.times) == ("ok", 3, [], True, {"arrival_time_ns": 7})


def _delta(text="", reasoning="", final=False, logprobs=None, reason=""):
    return Delta(text=text, reasoning=reasoning, n_tokens=1, finish_reason=reason, logprobs=logprobs,
                 num_input_tokens=4, num_cached_tokens=2, times={"arrival_time_ns": 5} if final else None, final=final)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("options", [{}, {"stream_options": {"include_usage": True}, "return_perf_metrics": True},
                                     {"stream_options": {"continuous_usage_stats": True}, "logprobs": True}],
                         ids=["plain", "usage-perf", "continuous-logprobs"])
def test_stream_events_are_the_compact_json_of_their_chunk(kind, options):
    """Events are written as strings around the escaped text; each must be exactly the compact
    json.dumps of its chunk, keys in OpenAI's order."""
    options = dict(options)
    if options.get("logprobs") and kind == "completion":
        options["logprobs"] = 1
    body = {"stream": True, "max_tokens": 4, **options}
    plan = (chat_plan({**body, "messages": [{"role": "user", "content": "hi"}]}, "k3") if kind == "chat"
            else completion_plan({**body, "prompt": "hi"}, "k3"))
    lp = [{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "é\""}}]
    deltas = [_delta("a\"\\\n\u2028é\x01", logprobs=lp), _delta("", reasoning="think\t", logprobs=lp),
              _delta("x", reasoning="y", logprobs=lp), _delta("", final=True, reason="cancelled", logprobs=[])]
    answer, reference = Answer(plan, "k3"), Answer(plan, "k3")
    for i, d in enumerate(deltas):
        got = answer.event(0, d)
        logprobs = reference.add(0, d)
        if kind == "chat":
            delta = {"content": d.text} if d.text else {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": d.text}
        choice |= {"logprobs": logprobs, "finish_reason": "abort" if d.final else None}
        if d.final and plan.perf_metrics:
            choice["perf_metrics"] = {"arrival_time_ns": 5}
        chunk = {"id": answer.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                 "created": answer.created, "model": "k3", "choices": [choice]}
        if plan.continuous_usage:
            chunk["usage"] = {"prompt_tokens": 4, "completion_tokens": i + 1, "total_tokens": i + 5,
                              "prompt_tokens_details": {"cached_tokens": 2}}
        elif plan.include_usage:
            chunk["usage"] = None
        assert got == f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
    assert answer.finished
    assert {**answer.body(), "id": None} == {**reference.body(), "id": None}


@pytest.mark.parametrize("cpus, requested, expected", [(2, 0, 1), (8, 0, 2), (16, 0, 4), (128, 0, 4), (None, 0, 1),
                                                         (2, 3, 3)])
def test_workers_default_to_one_per_four_cpus_at_most_four(monkeypatch, cpus, requested, expected):
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    assert workers(requested) == expected
    with pytest.raises(SystemExit, match="--workers"):
        workers(-1)
