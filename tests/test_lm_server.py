"""k3_lm and k3_ensemble on a real tritonserver (SERVING.md §10), the repository as shipped.

The server loads model_repository/ unchanged; its default checkpoint is the built-in tiny one,
created under K3_DEFAULT_CHECKPOINT (a per-session temp dir here) on first load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from k3client import collect, http_post, make_inputs, metric, metrics, png_data_uri, settled_metrics, stream_one

REPO = Path(__file__).resolve().parents[1] / "model_repository"
MODELS = ["k3_vision", "k3_lm", "k3_ensemble"]


@pytest.fixture(scope="module")
def server(triton_server, tmp_path_factory):
    os.environ["K3_DEFAULT_CHECKPOINT"] = str(tmp_path_factory.mktemp("ckpt") / "tiny-seed0")
    return triton_server(REPO, MODELS)


GREEDY = {"temperature": 0.0}


def test_CMP2_grpc_streaming_deltas_join_to_the_non_streamed_text(server):
    base = {"text_input": "The capital of France is", "max_tokens": 24, **GREEDY}
    streamed = stream_one(server.grpc_url, "k3_ensemble", {**base, "stream": True})
    single = stream_one(server.grpc_url, "k3_ensemble", {**base, "stream": False})
    assert streamed.error is None and streamed.final
    for r in streamed.responses[:-1]:  # [STR-3]: every non-final delta is non-empty
        assert r["text_output"].shape == (1, 1) and r["text_output"][0, 0]
    assert len(single.responses) == 1  # [STR-1]
    assert streamed.text == single.text and streamed.text


def test_CMP3_unary_infer_on_a_decoupled_model_is_unsupported(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="(?i)decoupled|unsupported|unimplemented"):
        client.infer("k3_ensemble", make_inputs({"text_input": "hi", "max_tokens": 2}))
    client.close()


def test_CMP6_http_generate_returns_one_json_object(server):
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {
        "text_input": "The capital of France is", "max_tokens": 16, "temperature": 0,
        "return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert status == 200, body
    out = json.loads(body)
    assert isinstance(out["text_output"], str) and out["finish_reason"] in ("stop", "length")
    assert out["num_input_tokens"] == len("The capital of France is".encode())  # byte-level tiny vocabulary
    assert 1 <= out["num_output_tokens"] <= 16


def test_CMP7_http_generate_stream_sends_sse_deltas(server):
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate_stream",
                             {"text_input": "Count to five:", "max_tokens": 32, "stream": True, "temperature": 0})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert events and events[0]["text_output"]
    _, single = http_post(server.http_url, "/v2/models/k3_ensemble/generate",
                          {"text_input": "Count to five:", "max_tokens": 32, "temperature": 0})
    assert "".join(e["text_output"] for e in events) == json.loads(single)["text_output"]


def test_CMP8_vllm_dialect_sampling_parameters(server):
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {
        "text_input": "Hi", "return_finish_reason": True, "return_cumulative_logprob": True,
        "sampling_parameters": json.dumps({"temperature": "0", "max_tokens": "8", "stop": ["\n"]})})
    assert status == 200, body
    out = json.loads(body)
    assert out["finish_reason"] in ("stop", "length") and out["cumulative_logprob"] <= 0


def test_CMP9_image_chat_counts_image_tokens(server):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_uri(64, 48)}},
                                             {"type": "text", "text": "Describe the image."}]}]
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {
        "text_input": "", "messages": json.dumps(messages), "max_tokens": 8, "return_num_input_tokens": True})
    assert status == 200, body
    text_only = [{"role": "user", "content": "Describe the image."}]
    _, body2 = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {
        "text_input": "", "messages": json.dumps(text_only), "max_tokens": 8, "return_num_input_tokens": True})
    n_image = (48 + 8) // 28 * ((64 + 20) // 28)  # padded to 56x84 → 2x3 merged tokens
    framing = len("<|media_begin|>image 64x48<|media_content|>".replace("<|media_begin|>", "B")
                  .replace("<|media_content|>", "C")) + 1  # specials are one token, text is bytes
    assert json.loads(body)["num_input_tokens"] == json.loads(body2)["num_input_tokens"] + n_image + framing


def test_CMP9_raw_placeholder_and_count_mismatch(server):
    ok = stream_one(server.grpc_url, "k3_ensemble", {
        "text_input": "<|kimi_image_placeholder|>What is this?", "image_url_input": [png_data_uri()],
        "max_tokens": 4, "return_num_input_tokens": True})
    assert ok.error is None and ok.final
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {
        "text_input": "two <|kimi_image_placeholder|><|kimi_image_placeholder|>",
        "image_url_input": [png_data_uri()], "max_tokens": 4})
    assert status == 400 and "2 image placeholders but 1 image" in body


def test_concurrent_streams_are_independent(server):
    """8 concurrent streams (greedy and seeded) give exactly what each gives alone ([SMP-7])."""
    jobs = []
    for i in range(8):
        values = {"text_input": f"Request number {i} says", "max_tokens": 12, "stream": True,
                  "temperature": 0.0 if i % 2 else 0.8, "seed": 1000 + i, "ignore_eos": True}
        jobs.append(("k3_ensemble", values, f"c{i}"))
    alone = {rid: stream_one(server.grpc_url, m, v, rid) for m, v, rid in jobs}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    together = collect(client, jobs)
    client.close()
    for rid in alone:
        assert together[rid].error is None and together[rid].final
        assert together[rid].text == alone[rid].text, rid


def test_seeded_request_is_reproducible_and_logprobs_are_consistent(server):
    values = {"text_input": "Seeded", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 7,
              "stream": True, "return_log_probs": True, "return_num_output_tokens": True, "ignore_eos": True}
    a = stream_one(server.grpc_url, "k3_lm", values)
    b = stream_one(server.grpc_url, "k3_lm", values)
    assert a.text == b.text and a.total("num_output_tokens") == 10
    lp = np.concatenate([r["output_log_probs"].reshape(-1) for r in a.responses])
    assert len(lp) == 10 and np.all(lp <= 0)
    assert np.isclose(a.responses[-1]["cum_log_probs"].reshape(-1)[0], lp.sum(), atol=1e-4)


def test_STP4_ignore_eos_min_tokens_gives_exactly_max_tokens(server):
    s = stream_one(server.grpc_url, "k3_ensemble", {
        "text_input": "Hello", "max_tokens": 20, "min_tokens": 20, "ignore_eos": True, "stream": True,
        "return_num_output_tokens": True, "return_finish_reason": True})
    assert s.total("num_output_tokens") == 20
    assert s.responses[-1]["finish_reason"].reshape(-1)[0] == b"length"


def test_CMP4_grpc_cancel_frees_the_request(server):
    before = metrics(server.metrics_url)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    client.async_stream_infer("k3_lm", make_inputs({"text_input": "Go on forever", "max_tokens": 4096,
                                                    "ignore_eos": True, "stream": True}), request_id="cancel-me")
    deadline = time.time() + 60
    while sum(r is not None for r, _ in got) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert sum(r is not None for r, _ in got) >= 3
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.time() + 5
    while time.time() < deadline:
        after = metrics(server.metrics_url)
        if metric(after, "k3:num_requests_running") == 0 and \
                metric(after, "k3:request_success_total", finished_reason="cancelled") > \
                metric(before, "k3:request_success_total", finished_reason="cancelled"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"cancel not observed: running={metric(after, 'k3:num_requests_running')}")


def stop_a_long_ensemble_stream(server, request_id: str, stop_inputs: dict, final_timeout: float):
    """Start a 4096-token k3_ensemble stream, wait for its first response, then send `stop_inputs`
    (with "stop": True) under the same request id. Returns the stop's own answer, the target's final
    responses within `final_timeout`, and the target's errors."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer("k3_ensemble", make_inputs({
        "text_input": "Tell me a long story", "max_tokens": 4096, "ignore_eos": True, "stream": True,
        "return_finish_reason": True}), request_id=request_id)
    deadline = time.time() + 60
    while not results and time.time() < deadline:
        time.sleep(0.01)
    stop = stream_one(server.grpc_url, "k3_ensemble", stop_inputs, request_id=request_id)

    def final_responses() -> list:
        return [r for r, _ in results
                if r is not None and r.get_response().parameters["triton_final_response"].bool_param]

    deadline = time.time() + final_timeout
    while time.time() < deadline and not final_responses():
        time.sleep(0.05)
    client.stop_stream()
    client.close()
    return stop, final_responses(), [e for _, e in results if e]


def test_CMP5_stop_convention_through_the_ensemble(server):
    stop, finals, _ = stop_a_long_ensemble_stream(server, "job-42", {"text_input": "", "stop": True}, 5)
    assert stop.error is None and stop.final and stop.text == ""
    assert finals, "the target did not finish after the stop request"
    assert finals[-1].as_numpy("finish_reason").reshape(-1)[0] == b"cancelled"


def test_CAN3_stop_through_the_ensemble_ignores_its_other_inputs(server):
    """k3_vision answers a stop request without reading its other inputs: text that is not UTF-8 and
    an undecodable image do not keep the stop from reaching k3_lm and stopping the target."""
    stop, finals, errors = stop_a_long_ensemble_stream(
        server, "job-not-utf8", {"text_input": b"\xff\xfe not UTF-8", "image": ["not base64 !"], "stop": True}, 10)
    assert stop.error is None and stop.final and stop.text == "", stop.error
    assert finals, f"the target did not finish after the stop request: {errors}"
    assert finals[-1].as_numpy("finish_reason").reshape(-1)[0] == b"cancelled"


def test_CMP5_stop_over_http(server):
    out = {}

    def target():
        out["resp"] = http_post(server.http_url, "/v2/models/k3_ensemble/generate_stream", {
            "id": "job-http", "text_input": "Another long story", "max_tokens": 4096, "ignore_eos": True,
            "stream": True, "return_finish_reason": True})

    t = threading.Thread(target=target)
    t.start()
    time.sleep(1.0)
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate",
                             {"id": "job-http", "text_input": "", "stop": True})
    assert status == 200 and json.loads(body)["text_output"] == ""
    t.join(timeout=10)
    assert not t.is_alive()
    events = [json.loads(x[6:]) for x in out["resp"][1].splitlines() if x.startswith("data: ")]
    assert events[-1]["finish_reason"] == "cancelled"


BAD = [
    ({"text_input": "hi", "messages": '[{"role": "user", "content": "hi"}]'}, "INVALID_ARG",
     "either in text_input or in messages"),
    ({"text_input": "hi", "sampling_parameters": "{\"temperature\": 1,}"}, "INVALID_ARG", "not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": "{\"temprature\": 1}"}, "INVALID_ARG", "unknown key 'temprature'"),
    ({"text_input": "hi", "top_p": 1.5}, "INVALID_ARG", r"top_p must be in \(0, 1\], got 1.5"),
    ({"text_input": "hi", "min_tokens": 20, "min_length": 10, "max_tokens": 30}, "INVALID_ARG", "disagree"),
    ({"text_input": "hi", "max_tokens": 200000}, "INVALID_ARG", "exceeds max_model_len"),
    ({"text_input": "hi", "beam_width": 2}, "UNSUPPORTED", "beam_width"),
    ({"text_input": "hi", "sampling_parameters": "{\"top_k\": 1e20}"}, "INVALID_ARG",
     r"sampling_parameters.top_k must be an integer in \[-2\*\*31, 2\*\*31\) \(INT32\), got 1e\+20"),
    ({"text_input": "look <|kimi_image_placeholder|>", "image": ["bm90IGFuIGltYWdl"]}, "INVALID_ARG",
     "cannot decode image data"),
    ({"text_input": "", "stop": True}, "INVALID_ARG", "needs a request id"),
]


@pytest.mark.parametrize("values, code, message", BAD, ids=[
    "two-sources", "bad-json", "unknown-key", "range", "alias", "too-long", "beam", "huge-top-k", "bad-image",
    "stop-no-id"])
def test_ERR_client_mistakes_get_their_code_and_a_good_request_follows(server, values, code, message):
    rid = "" if values.get("stop") else "bad"
    bad = stream_one(server.grpc_url, "k3_ensemble", {"max_tokens": 4, **values}, request_id=rid)
    assert bad.error is not None and code in bad.error, bad.error
    assert re.search(message, bad.error), bad.error
    assert "INTERNAL" not in bad.error
    good = stream_one(server.grpc_url, "k3_ensemble", {"text_input": "still fine", "max_tokens": 3})
    assert good.error is None and good.final


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
@pytest.mark.parametrize("model", ["k3_ensemble", "k3_lm"])
def test_ERR1_http_status_of_a_model_error_is_400_on_triton_2_51(server, model, endpoint):
    """SERVING.md §7.3 asks 501 for UNSUPPORTED, but Triton 2.51's generate endpoints answer 400 for
    every error a model sends (tests/test_triton_error_codes.py pins the whole table), so HTTP
    clients read the code from the message. A Triton that fixes this fails here: update docs/errors.md."""
    status, body = http_post(server.http_url, f"/v2/models/{model}/{endpoint}",
                             {"text_input": "hi", "max_tokens": 4, "beam_width": 2})
    error = json.loads(body.removeprefix("data: "))["error"]
    prefix = "in ensemble 'k3_ensemble', " if model == "k3_ensemble" else ""
    assert (status, error) == (400, prefix + "k3_lm: UNSUPPORTED: beam_width > 1 is not supported"), (status, body)


def test_http_generate_number_conversion_is_triton_s_on_2_51(server):
    """What Triton's /generate does with JSON numbers before k3_lm sees them (docs/errors.md, "What
    each protocol shows"): a wrong kind is 500 from Triton's parser, an integer beyond INT32 wraps around."""
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate",
                             {"text_input": "hi", "max_tokens": 2.5})
    assert status == 500 and "Unable to parse 'data'" in body, (status, body)
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {
        "text_input": "hi", "max_tokens": 2**32 + 2, "ignore_eos": True, "return_num_output_tokens": True})
    assert (status, json.loads(body)["num_output_tokens"]) == (200, 2), body


def test_metrics_counters_move(server):
    before = settled_metrics(server.metrics_url)
    s = stream_one(server.grpc_url, "k3_ensemble", {"text_input": "count me", "max_tokens": 5, "ignore_eos": True,
                                                    "min_tokens": 5, "return_num_input_tokens": True})
    assert s.error is None
    deadline = time.time() + 5  # updates are applied by the metrics thread ([MET-2])
    while True:
        after = metrics(server.metrics_url)
        moved = {name: metric(after, name) - metric(before, name) for name in (
            "k3:prompt_tokens_total", "k3:generation_tokens_total", "k3:time_to_first_token_seconds_count",
            "k3:e2e_request_latency_seconds_count", "k3:time_per_output_token_seconds_count")}
        if moved["k3:e2e_request_latency_seconds_count"] >= 1 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert moved["k3:prompt_tokens_total"] == len(b"count me")  # [TOK-3]
    assert moved["k3:generation_tokens_total"] == 5
    assert moved["k3:time_to_first_token_seconds_count"] == 1 and moved["k3:e2e_request_latency_seconds_count"] == 1
    assert moved["k3:time_per_output_token_seconds_count"] == 1  # one per response: this one is not streamed
    assert metric(after, "k3:engine_healthy") == 1


def test_CMP10_perf_analyzer_streaming_ensemble(server, perf_analyzer, tmp_path):
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps({"data": [{"text_input": ["Hello"], "max_tokens": [16], "min_tokens": [16],
                                          "ignore_eos": [True], "stream": [True]}]}))
    proc = subprocess.run([str(perf_analyzer), "-m", "k3_ensemble", "-i", "grpc", "-u", server.grpc_url,
                           "--async", "--streaming", "--input-data", str(data), "--concurrency-range", "1:2",
                           "--measurement-mode", "count_windows", "--measurement-request-count", "8",
                           "--stability-percentage", "100"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.lower().replace("errors: 0", ""), proc.stdout[-2000:]


def _config(server, model: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/config", timeout=10) as r:
        return json.loads(r.read())


def test_CFG_E3_ensemble_lm_and_vision_declare_the_same_tensors(server):
    ens, lm, vis = (_config(server, m) for m in ("k3_ensemble", "k3_lm", "k3_vision"))
    sig = lambda io: {t["name"]: (t["data_type"], tuple(t["dims"])) for t in io}  # noqa: E731
    image_inputs = {"image_url_input", "image", "image_bytes_input"}
    internal = {"image_embeds", "image_token_counts", "image_grid_thw", "image_sizes", "image_hashes"}
    ens_in, lm_in, vis_in = sig(ens["input"]), sig(lm["input"]), sig(vis["input"])
    assert {k: v for k, v in ens_in.items() if k not in image_inputs} == \
        {k: v for k, v in lm_in.items() if k not in internal}
    assert all(t.get("optional") for t in ens["input"])
    assert all(ens_in[k] == v for k, v in vis_in.items())
    # [ENS-1]: step 1 gets each of k3_vision's inputs from the ensemble input of the same name, `stop`
    # included, declared as k3_lm declares it, so k3_vision can pass stop requests through [CAN-3].
    steps = {s["model_name"]: s for s in ens["ensemble_scheduling"]["step"]}
    assert steps["k3_vision"]["input_map"] == {k: k for k in vis_in}
    assert vis_in["stop"] == lm_in["stop"] == ens_in["stop"]
    assert sig(ens["output"]) == sig(lm["output"])  # [TOP-2]: every ensemble output comes from k3_lm
    vis_out = sig(vis["output"])
    assert {k: lm_in[k] for k in internal} == vis_out  # [ENS-3]: same dtype for image_embeds
    assert ens["max_batch_size"] == lm["max_batch_size"] == 1 and ens["model_transaction_policy"]["decoupled"]
    # [TOP-6]: text_input is required by k3_lm and k3_vision. The ensemble declares it optional: Triton
    # 2.51 does not enforce required ensemble inputs, and a required one that is missing stalls the
    # ensemble (no response at all); optional, a missing one reaches k3_vision, whose core check refuses it.
    assert [t["name"] for t in lm["input"] if not t.get("optional")] == ["text_input"]
    assert [t["name"] for t in vis["input"] if not t.get("optional")] == ["text_input"]
    assert [t["name"] for t in ens["input"] if not t.get("optional")] == []


def test_CAN7_stop_before_arrival_leaves_a_tombstone(server):
    stop = stream_one(server.grpc_url, "k3_lm", {"text_input": "", "stop": True}, request_id="early-bird")
    assert stop.error is None and stop.text == ""
    late = stream_one(server.grpc_url, "k3_lm", {"text_input": "never generated", "max_tokens": 64,
                                                 "return_finish_reason": True, "return_num_output_tokens": True},
                      request_id="early-bird")
    assert late.error is None and late.final and late.text == ""
    assert late.responses[-1]["finish_reason"].reshape(-1)[0] == b"cancelled"
    assert late.total("num_output_tokens") == 0
    again = stream_one(server.grpc_url, "k3_lm", {"text_input": "now it runs", "max_tokens": 3, "min_tokens": 3,
                                                  "ignore_eos": True, "return_num_output_tokens": True},
                       request_id="early-bird")  # the tombstone is consumed by the first request it stops
    assert again.total("num_output_tokens") == 3


def test_CMP4_cancel_storm_leaves_nothing_running(server):
    """32 concurrent k3_lm streams cancelled mid-generation: the running/waiting gauges return to idle."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: list = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    for i in range(32):
        client.async_stream_infer("k3_lm", make_inputs({"text_input": f"storm {i}", "max_tokens": 4096,
                                                        "ignore_eos": True, "stream": True}), request_id=f"s{i}")
    deadline = time.time() + 60
    while len(got) < 32 and time.time() < deadline:
        time.sleep(0.02)
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        m = metrics(server.metrics_url)
        if metric(m, "k3:num_requests_running") == 0 and metric(m, "k3:num_requests_waiting") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"running={metric(m, 'k3:num_requests_running')} waiting={metric(m, 'k3:num_requests_waiting')}")
    ok = stream_one(server.grpc_url, "k3_lm", {"text_input": "after the storm", "max_tokens": 3})
    assert ok.error is None and ok.final


@pytest.mark.parametrize("body", [{"max_tokens": 4}, {"max_tokens": 4, "stream": True}],
                         ids=["no-prompt", "no-prompt-stream"])
def test_missing_text_input_through_the_ensemble_is_invalid_arg(server, body):
    """Finding: without text_input the ensemble used to answer 200 with no output, or nothing at all."""
    for path in ("/generate", "/generate_stream"):
        status, text = http_post(server.http_url, f"/v2/models/k3_ensemble{path}", body)
        assert status == 400 and "missing required input(s) ['text_input']" in text, (path, status, text)
    out = stream_one(server.grpc_url, "k3_ensemble", body)
    assert out.final and "missing required input(s) ['text_input']" in (out.error or ""), out


def test_messages_without_text_input_through_the_ensemble_answers(server):
    messages = json.dumps([{"role": "user", "content": "Say hi"}])
    base = {"messages": messages, "max_tokens": 4, "min_tokens": 4, "ignore_eos": True, "temperature": 0.0,
            "return_num_output_tokens": True}
    status, text = http_post(server.http_url, "/v2/models/k3_ensemble/generate", base)
    assert status == 200 and json.loads(text)["num_output_tokens"] == 4, text
    streamed = stream_one(server.grpc_url, "k3_ensemble", {**base, "stream": True})
    assert streamed.error is None and streamed.final and streamed.total("num_output_tokens") == 4
    with_empty = stream_one(server.grpc_url, "k3_ensemble", {**base, "text_input": ""})
    assert with_empty.text == json.loads(text)["text_output"] == streamed.text


def test_repeated_long_prompt_is_served_from_the_prefix_cache(server):
    """[IMG-4]/§9: the second identical long prompt reuses the first one's blocks and KDA snapshot:
    num_cached_tokens (return_perf_metrics) and the prefix-cache counters show it; text is the same."""
    body = {"text_input": "a long shared system prompt, " * 12, "max_tokens": 4, "temperature": 0,
            "return_perf_metrics": True, "return_num_input_tokens": True}
    before = settled_metrics(server.metrics_url, "k3:prefix_cache_queries_total")
    first = json.loads(http_post(server.http_url, "/v2/models/k3_lm/generate", body)[1])
    second = json.loads(http_post(server.http_url, "/v2/models/k3_lm/generate", body)[1])
    n = first["num_input_tokens"]
    assert first["num_cached_tokens"] == 0 and n > 128
    assert second["num_cached_tokens"] == (n - 1) // 64 * 64  # every full block before the last token
    assert second["text_output"] == first["text_output"]
    for r in (first, second):  # waited, then scheduled, then its first and last token
        times = [r[k] for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
        assert times == sorted(times) and times[1] < times[2], times

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    after, deadline = metrics(server.metrics_url), time.time() + 5
    while delta("k3:prefix_cache_queries_total") < 2 * n and time.time() < deadline:
        time.sleep(0.2)
        after = metrics(server.metrics_url)
    assert delta("k3:prefix_cache_hits_total") == second["num_cached_tokens"]
    assert delta("k3:prefix_cache_queries_total") == 2 * n
