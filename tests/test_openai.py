"""The OpenAI gateway (docs/openai.md) on a real tritonserver, through the official openai package.

Every answer is checked against k3_ensemble's own answer to the same request over gRPC: the
gateway must add nothing and lose nothing. One gateway subprocess serves the module; the
tritonserver is the shared one of test_lm_server.py (same repository and models).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from gatewayutil import Gateway, http_status
from k3client import collect, http_post, metric, metrics, png_data_uri, stream_one
from serverutil import alive, child_pids, wait_until

from k3backend.tritonserver import free_port

REPO = Path(__file__).resolve().parents[1] / "model_repository"
MODELS = ["k3_vision", "k3_lm", "k3_ensemble"]
KEY = "test-key-20"
LIMIT = 2 * 2**20  # the gateway's --max-request-bytes here


@pytest.fixture(scope="module")
def server(triton_server, tmp_path_factory):
    os.environ.setdefault("K3_DEFAULT_CHECKPOINT", str(tmp_path_factory.mktemp("ckpt") / "tiny-seed0"))
    return triton_server(REPO, MODELS)


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    gw = Gateway(server.grpc_url, tmp_path_factory.mktemp("gw") / "gateway.log", "--max-request-bytes", str(LIMIT),
                 api_key=KEY)
    yield gw
    assert gw.stop() == 0, gw.log_path.read_text()


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ensemble(server, values: dict):
    """k3_ensemble's answer over gRPC, with the counts the gateway reads."""
    s = stream_one(server.grpc_url, "k3_ensemble", {
        **values, "return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True},
        request_id=uuid.uuid4().hex)
    assert s.error is None and s.final, s.error
    return s


def joined(stream, name: str) -> str:
    return "".join(r[name].reshape(-1)[0].decode() for r in stream.responses if name in r)


def chat_reference(server, messages, **values):
    return ensemble(server, {"text_input": "", "messages": json.dumps(messages), "return_reasoning": True, **values})


def read_chat_stream(chunks) -> tuple[str, str, str | None, object]:
    """(content, reasoning, finish_reason, usage) of a streamed chat completion."""
    content, reasoning, finish, usage = [], [], None, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            content.append(c.delta.content or "")
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            finish = c.finish_reason or finish
    return "".join(content), "".join(reasoning), finish, usage


# ---- equal to the ensemble --------------------------------------------------------------------


@pytest.mark.parametrize("stream,thinking", [(False, False), (True, True)], ids=["whole", "streamed-thinking"])
def test_chat_equals_the_ensembles_greedy_output_and_counts(server, client, stream, thinking):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say hi {stream}"}]
    values = {"max_tokens": 24, "temperature": 0.0, "chat_template_kwargs": json.dumps({"thinking": thinking})}
    ref = chat_reference(server, messages, **values)
    warm = chat_reference(server, messages, **values, return_perf_metrics=True)  # the prefix cache now holds it
    assert joined(warm, "text_output") == joined(ref, "text_output")
    kwargs = dict(model="k3", messages=messages, max_tokens=24, temperature=0, extra_body={"thinking": thinking})
    if stream:
        content, reasoning, finish, usage = read_chat_stream(client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
    else:
        r = client.chat.completions.create(**kwargs)
        content, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        reasoning = getattr(r.choices[0].message, "reasoning_content", None) or ""
    assert content == joined(ref, "text_output")
    assert reasoning == joined(ref, "reasoning_output")
    assert finish == ref.responses[-1]["finish_reason"].reshape(-1)[0].decode()
    assert usage.prompt_tokens == int(ref.responses[0]["num_input_tokens"].reshape(-1)[0])
    assert usage.completion_tokens == ref.total("num_output_tokens")
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == int(warm.responses[0]["num_cached_tokens"].reshape(-1)[0]) > 0


@pytest.mark.parametrize("stream,echo", [(False, True), (True, False)], ids=["whole-echo", "streamed"])
def test_completion_equals_the_ensembles_greedy_output(server, client, stream, echo):
    prompt = f"The capital of France is {stream}"
    ref = ensemble(server, {"text_input": prompt, "max_tokens": 20, "temperature": 0.0,
                            "exclude_input_in_output": not echo})
    kwargs = dict(model="k3", prompt=prompt, max_tokens=20, temperature=0, echo=echo)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                                extra_body={"return_perf_metrics": True}))
        text = "".join(c.text for ch in chunks for c in ch.choices)
        finish = [c.finish_reason for ch in chunks for c in ch.choices][-1]
        usage = chunks[-1].usage
        assert all(ch.usage is None for ch in chunks[:-1]) and not chunks[-1].choices
        times = chunks[-2].choices[0].perf_metrics  # the extension, in the choice's last chunk
        assert 0 < times["arrival_time_ns"] <= times["first_token_time_ns"] <= times["last_token_time_ns"]
    else:
        r = client.completions.create(**kwargs)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert text == ref.text and text.startswith(prompt) == echo
    assert finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        int(ref.responses[0]["num_input_tokens"].reshape(-1)[0]), ref.total("num_output_tokens"))


def test_image_chat_equals_the_ensembles_image_request(server, client):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_uri(64, 48, seed=3),
                                                                                "detail": "low"}},
                                             {"type": "text", "text": "Describe the image."}]}]
    k3_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_uri(64, 48, seed=3)}},
                                                {"type": "text", "text": "Describe the image."}]}]
    ref = chat_reference(server, k3_messages, max_tokens=12, temperature=0.0)
    r = client.chat.completions.create(model="k3", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == joined(ref, "text_output")
    assert r.usage.prompt_tokens == int(ref.responses[0]["num_input_tokens"].reshape(-1)[0])
    assert r.usage.prompt_tokens > 20  # the image's pad positions are counted


def _vision_requests(server) -> int:
    """Requests k3_vision has executed (Triton's model statistics): the ensemble's first step."""
    with urllib.request.urlopen(f"{server.http_url}/v2/models/k3_vision/stats", timeout=10) as r:
        return json.load(r)["model_stats"][0]["inference_stats"]["success"]["count"]


def test_text_goes_straight_to_k3_lm_and_images_through_the_ensemble(server, client, tmp_path):
    text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Route"}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_uri(32, 32, seed=5)}},
                                          {"type": "text", "text": "Route"}]}]
    before = _vision_requests(server)
    client.chat.completions.create(model="k3", messages=text, max_tokens=2, temperature=0)
    client.completions.create(model="k3", prompt="Route", max_tokens=2, temperature=0)
    assert _vision_requests(server) == before  # --text-model k3_lm (the default)
    client.chat.completions.create(model="k3", messages=image, max_tokens=2, temperature=0)
    wait_until(lambda: _vision_requests(server) == before + 1, 10, "k3_vision to count the image request", 0.05)
    gw = Gateway(server.grpc_url, tmp_path / "gateway.log", "--text-model", "")  # everything through the ensemble
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=120)
        c.chat.completions.create(model="k3", messages=text, max_tokens=2, temperature=0)
        wait_until(lambda: _vision_requests(server) == before + 2, 10, "k3_vision to count the text request", 0.05)
    finally:
        assert gw.stop() == 0


def test_sampling_fields_and_stop_reach_k3(server, client):
    prompt = "Sampling check:"
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "min_p": 0.01, "presence_penalty": 0.5,
                "frequency_penalty": 0.25, "repetition_penalty": 1.1, "seed": 11}
    ref = ensemble(server, {"text_input": prompt, "max_tokens": 16, **sampling})
    extra = {k: sampling[k] for k in ("top_k", "min_p", "repetition_penalty")}
    r = client.completions.create(model="k3", prompt=prompt, max_tokens=16, extra_body=extra,
                                  **{k: v for k, v in sampling.items() if k not in extra})
    assert r.choices[0].text == ref.text
    # stop: a piece of the greedy text ends it early, with finish_reason stop
    greedy = ensemble(server, {"text_input": prompt, "max_tokens": 16, "temperature": 0.0}).text
    stop = [ch for ch in greedy if ch != "\ufffd"][-1]  # its first occurrence cuts the text short
    ref = ensemble(server, {"text_input": prompt, "max_tokens": 16, "temperature": 0.0, "stop_words": [stop, "never"]})
    r = client.completions.create(model="k3", prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "never"])
    assert r.choices[0].text == ref.text and len(ref.text) < len(greedy)
    assert r.choices[0].finish_reason == "stop"


def test_n_fans_out_with_one_seed_per_choice(server, client):
    messages = [{"role": "user", "content": "Pick a word"}]
    r = client.chat.completions.create(model="k3", messages=messages, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    refs = [chat_reference(server, messages, max_tokens=8, temperature=1.0, seed=5 + j) for j in range(3)]
    assert [c.message.content for c in r.choices] == [joined(ref, "text_output") for ref in refs]
    assert r.usage.completion_tokens == sum(ref.total("num_output_tokens") for ref in refs)
    assert r.usage.prompt_tokens == int(refs[0].responses[0]["num_input_tokens"].reshape(-1)[0])  # counted once
    # ignore_eos and min_tokens as extra fields: exactly max_tokens tokens in each choice
    r = client.completions.create(model="k3", prompt="x", max_tokens=6, n=2, stream=False,
                                  extra_body={"ignore_eos": True, "min_tokens": 6})
    assert r.usage.completion_tokens == 12 and {c.finish_reason for c in r.choices} == {"length"}


def test_logprobs_equal_the_ensembles(server, client):
    messages = [{"role": "user", "content": "Log-probs"}]
    ref = chat_reference(server, messages, max_tokens=6, temperature=0.0, return_log_probs=True)
    want = np.concatenate([r["output_log_probs"].reshape(-1) for r in ref.responses])
    r = client.chat.completions.create(model="k3", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    np.testing.assert_allclose([t.logprob for t in content], want, atol=1e-5)
    for t in content:
        assert len(t.top_logprobs) == 3
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the sampled token is the top one
        assert t.bytes == list(t.token.encode())
    ref = ensemble(server, {"text_input": "Hi", "max_tokens": 5, "temperature": 0.0, "return_log_probs": True,
                            "stream": True})
    chunks = list(client.completions.create(model="k3", prompt="Hi", max_tokens=5, temperature=0, logprobs=2,
                                            stream=True))
    got = [x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs]
    np.testing.assert_allclose(got, np.concatenate([r["output_log_probs"].reshape(-1) for r in ref.responses]),
                               atol=1e-5)


# ---- errors -----------------------------------------------------------------------------------

CHAT = {"model": "k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body,match", [
    ({**CHAT, "temperature": "hot"}, "temperature must be a number"),
    ({**CHAT, "top_p": 1.5}, r"k3_lm: INVALID_ARG: top_p must be in \(0, 1\]"),
    ({**CHAT, "temprature": 0.5}, "Unrecognized request argument supplied: temprature"),
    ({**CHAT, "n": 0}, "n must be at least 1"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools is not supported"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "UNSUPPORTED: .*tool"),
    ({**CHAT, "messages": []}, "messages must be a non-empty array"),
    ({**CHAT, "max_tokens": 2**40}, "max_tokens must fit a 32-bit integer"),
    ({**CHAT, "stream": True, "max_tokens": 200000}, "exceeds max_model_len"),
], ids=["type", "range", "unknown-field", "n", "tools", "tool-role", "no-messages", "int32", "streamed"])
def test_bad_parameter_is_400_with_the_cause(gateway, body, match):
    status, text = http_post(gateway.url, "/v1/chat/completions", body, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and re.search(match, error["message"]), error


def test_error_statuses_through_the_openai_client(gateway, client):
    with pytest.raises(openai.BadRequestError, match="top_p"):  # streamed: refused before any data
        client.chat.completions.create(model="k3", messages=CHAT["messages"], top_p=2.0, stream=True)
    bad = openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="k3", messages=CHAT["messages"])
    assert http_status(gateway.url + "/v1/models") == 401 and http_status(gateway.url + "/health") == 200
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "x" * (LIMIT + 1)}])
    assert e.value.status_code == 413
    status, text = http_post(gateway.url, "/v1/chat/completions", None, raw=b"{not json",
                             headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
    assert http_status(gateway.url + "/v1/nothing", {"Authorization": f"Bearer {KEY}"}) == 404
    assert [m.id for m in client.models.list().data] == ["k3"]


def test_unreachable_triton_is_503(tmp_path):
    gw = Gateway(f"127.0.0.1:{free_port()}", tmp_path / "gateway.log")
    try:
        assert http_status(gw.url + "/health") == 503
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="k3", messages=CHAT["messages"])
        assert e.value.status_code == 503
    finally:
        assert gw.stop() == 0


# ---- cancellation and concurrency ---------------------------------------------------------------


def _running(server) -> float:
    return metric(metrics(server.metrics_url), "k3:num_requests_running", model="k3_lm")


def _freed_within(server, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(server) != 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_disconnect_mid_stream_stops_the_request_within_2s(server, client):
    long = dict(model="k3", messages=[{"role": "user", "content": "Tell me a long story"}], max_tokens=4000,
                extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(**long, stream=True)
    try:
        for i, _ in enumerate(stream):
            if i == 3:
                break
        wait_until(lambda: _running(server) == 1, 10, "k3_lm's running gauge (published every 0.25 s) to show it", 0.05)
    finally:
        stream.close()  # a failed check must not leave 4000 tokens running into the next test
    assert _freed_within(server, 2.0)


def test_disconnect_during_a_whole_answer_stops_it_too(server, gateway):
    body = json.dumps({**CHAT, "max_tokens": 4000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        wait_until(lambda: _running(server) == 1, 10, "k3_lm's running gauge (published every 0.25 s) to show it", 0.05)
    assert _freed_within(server, 2.0)


def test_sixteen_concurrent_streams_are_each_exact(server, gateway):
    prompts = [f"Concurrent prompt {i}: once upon a time" for i in range(16)]  # 16 x 16 tokens
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    refs = collect(grpc, [("k3_ensemble", {"text_input": p, "max_tokens": 16, "temperature": 0.0, "stream": True,
                                           "return_num_output_tokens": True}, f"c{i}-{uuid.uuid4().hex}")
                          for i, p in enumerate(prompts)])
    grpc.close()
    refs = list(refs.values())  # in the order sent

    async def run() -> list[tuple[str, int]]:
        c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(p: str) -> tuple[str, int]:
            text, usage = [], None
            async for ch in await c.completions.create(model="k3", prompt=p, max_tokens=16, temperature=0, stream=True,
                                                       stream_options={"include_usage": True}):
                text += [x.text for x in ch.choices]
                usage = ch.usage or usage
            return "".join(text), usage.completion_tokens

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await c.close()

    got = asyncio.run(run())
    assert got == [(ref.text, ref.total("num_output_tokens")) for ref in refs]


def test_workers_share_the_port_and_stop_together(server, tmp_path):
    gw = Gateway(server.grpc_url, tmp_path / "gateway.log", "--workers", "2")
    workers = child_pids(gw.process.pid)
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        texts = {c.completions.create(model="k3", prompt="Workers", max_tokens=4, temperature=0).choices[0].text
                 for _ in range(3)}
        assert len(texts) == 1 and len(workers) == 2  # two gateway processes behind one port
    finally:
        assert gw.stop() == 0
    assert not any(alive(pid) for pid in workers)
