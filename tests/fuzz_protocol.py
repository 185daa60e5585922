"""Fuzz classes below the contract: Triton-level garbage ([IN-1]: unknown names, wrong dtypes and
shapes, batch size 2, empty tensors, broken protobufs and HTTP bodies) and protocol abuse
(streams cancelled or dropped mid-generation, HTTP connections closed early, a stop racing its
target, duplicated request ids: SERVING.md §6).

Abandoned generations are stopped by id afterwards (`Case.cleanup`): the way k3_ensemble and
HTTP clients free the engine ([CAN-2]), and it keeps the fuzz from filling the engine queue.
"""

from __future__ import annotations

import json

import numpy as np

from fuzz_gen import CORE, GEN_PROTOCOLS, OK, PARSE, PLACEHOLDER, Case, Gen
from fuzz_images import data_uri, encoded_image
from fuzz_wire import NP_TYPES, Request, Wire, declared, infer_request_proto, json_bytes

ANY_MODEL = ("k3_ensemble", "k3_lm", "k3_vision")
TRITON_HTTP = CORE | PARSE  # Triton's HTTP frontend answers bad bodies with 400 or its parser's 500
DTYPE_SWAPS = {"INT32": ("FP32", "INT64", "BYTES", "BOOL", "UINT32"), "FP32": ("FP64", "FP16", "INT32"),
               "BOOL": ("INT32", "UINT8"), "BYTES": ("INT32", "UINT8"), "UINT64": ("INT64", "FP64"),
               "UINT8": ("INT8", "INT32", "FP32"), "BF16": ("FP32", "FP16"), "INT64": ("INT32",)}
SAMPLE_VALUES = {"BYTES": b"x", "INT32": 1, "FP32": 0.5, "BOOL": True, "UINT64": 1, "INT64": 1, "UINT8": 1}


def _plain(g: Gen, model: str) -> tuple[str, dict]:
    """A protocol and a valid request for `model` (k3_vision: a text-only one)."""
    if model == "k3_vision":
        return g.choice(("grpc_infer", "http_infer")), {"text_input": g.text()}
    protocol = g.choice(("grpc", "grpc_raw"))
    return protocol, g.cheap("grpc")


def _array(datatype: str, shape: tuple[int, ...], value) -> np.ndarray:
    return np.full(shape, value, dtype=NP_TYPES.get(datatype, np.object_))


# ---- Triton-level garbage (gRPC) ---------------------------------------------------------------


def unknown_input(g: Gen) -> Case:
    """[IN-1]: an input name no config declares is refused by Triton core."""
    model = g.choice(ANY_MODEL)
    protocol, values = _plain(g, model)
    name = g.choice(("temprature", "max_token", "image_input", "lora_weights", "TEXT_INPUT", "text_input ", "../x",
                     "a" * 1000, "\u00e9", "video_bytes_input", "max_tokens" if model == "k3_vision" else "embedding_bias"))
    values[name] = Wire("INT32", np.array([[1]], np.int32))
    return g.case(f"core/unknown-input/{model}", CORE, values, model=model, protocol=protocol)


def wrong_dtype(g: Gen) -> Case:
    """[IN-1]: a declared input sent with another datatype is refused by Triton core (over /infer
    its JSON parser may refuse the data first, with a 500)."""
    model = g.choice(ANY_MODEL)
    protocol, values = _plain(g, model)
    name, datatype = g.choice(sorted(declared(model).items()))
    swapped = g.choice(DTYPE_SWAPS[datatype])
    dims = (1, 1, 2, 2, 3) if name == "image_bytes_input" else (1, 3, 4) if name == "image_embeds" else (1, 1)
    values[name] = Wire(swapped, _array(swapped, dims, SAMPLE_VALUES.get(swapped, 1)))
    expect = TRITON_HTTP if protocol == "http_infer" else CORE
    return g.case(f"core/dtype/{name}-{swapped}", expect, values, model=model, protocol=protocol)


def wrong_shape(g: Gen) -> Case:
    """Declared [1] scalars sent as [1, 2], [1, 1, 1] or [1]; image tensors with too few dims."""
    model = g.choice(("k3_ensemble", "k3_lm"))
    protocol, values = _plain(g, model)
    name = g.choice(("text_input", "max_tokens", "temperature", "stream", "messages", "seed", "image_bytes_input"))
    if name == "image_bytes_input" and model == "k3_lm":
        name = "image_embeds"
    datatype = declared(model)[name]
    shape = g.choice(((1, 2), (1, 1, 1), (1,), (1, 0))) if name not in ("image_bytes_input", "image_embeds") else \
        g.choice(((1, 2, 2, 3), (1, 4), (1, 1, 1, 2, 2, 3)))
    values[name] = Wire(datatype, _array(datatype, shape, SAMPLE_VALUES.get(datatype, 0)))
    return g.case(f"core/shape/{name}-{list(shape)}", CORE, values, model=model, protocol=protocol)


def batch_size(g: Gen) -> Case:
    """Batch 2: refused by core for the LM models (max_batch_size 1, [CFG-E1]); k3_vision batches
    (max_batch_size 16) and refuses a two-prompt request itself."""
    model = g.choice(ANY_MODEL)
    protocol, values = _plain(g, model)
    mixed = g.chance(0.3)  # one input with batch 2, the rest with 1: core's batch mismatch
    for name, value in list(values.items()):
        if isinstance(value, Wire) or (mixed and name != "text_input"):
            continue
        datatype = declared(model)[name]
        values[name] = Wire(datatype, _array(datatype, (2, 1), value.encode() if isinstance(value, str) else value))
    expect = frozenset({"INVALID_ARG"}) if model == "k3_vision" and not mixed else CORE
    if model == "k3_vision" and mixed:
        expect = frozenset({"INVALID_ARG", "TRITON"})
    return g.case(f"core/batch2/{model}{'-mixed' if mixed else ''}", expect, values, model=model, protocol=protocol)


def empty_tensor(g: Gen) -> Case:
    """Zero elements: fine for list inputs ([-1] dims), refused for [1] scalars and batch 0."""
    model = g.choice(("k3_ensemble", "k3_lm"))
    protocol, values = _plain(g, model)
    name, expect = g.choice((("stop_words", OK), ("bad_words", OK), ("stop_token_ids", OK), ("text_input", CORE),
                             ("max_tokens", CORE), ("sampling_parameters", CORE), ("batch0", CORE)))
    if name == "batch0":
        values["text_input"] = Wire("BYTES", np.zeros((0, 1), np.object_))
    else:
        datatype = declared(model)[name]
        values[name] = Wire(datatype, np.zeros((1, 0), _array(datatype, (1,), 0).dtype))
    if model == "k3_ensemble" and g.chance(0.3):  # an empty image list too: zero images, zero placeholders
        values["image_url_input"] = Wire("BYTES", np.zeros((1, 0), np.object_))
    return g.case(f"core/empty/{name}", expect, values, model=model, protocol=protocol)


def broken_proto(g: Gen) -> Case:
    """A raw ModelInferRequest with inconsistent contents: a cut BYTES length prefix, byte counts
    that do not match the shape, missing or extra raw contents, bad dims or datatypes. (A length
    prefix that overstates its data is `overstated_bytes_length`, a known defect.)"""
    model = g.choice(("k3_ensemble", "k3_lm"))
    request = Request(model, g.cheap("grpc"), g.rid())
    proto = infer_request_proto(request)
    names = [t.name for t in proto.inputs]
    i = names.index(g.choice(names))
    raw = proto.raw_input_contents
    variant = g.choice(("bytes-length-cut", "byte-count", "missing-raw", "extra-raw",
                        "negative-dim", "huge-dim", "no-shape", "datatype", "duplicate", "empty-name",
                        "bad-parameter"))
    expect = CORE
    if variant == "bytes-length-cut":
        i = names.index("text_input")
        raw[i] = raw[i][:g.rng.randint(0, 3)]
    elif variant == "byte-count":
        raw[i] = raw[i] + b"\x00" if g.chance(0.5) else raw[i][:-1]
    elif variant == "missing-raw":
        del raw[i]
    elif variant == "extra-raw":
        raw.append(b"\x01\x02\x03\x04")
        expect = frozenset({"ok", "TRITON"})  # Triton ignores contents beyond the inputs
    elif variant in ("negative-dim", "huge-dim", "no-shape"):
        del proto.inputs[i].shape[:]
        proto.inputs[i].shape.extend({"negative-dim": [1, -1], "huge-dim": [1, 2**40], "no-shape": []}[variant])
    elif variant == "datatype":
        proto.inputs[i].datatype = g.choice(("STRING", "", "int32", "BF17"))
    elif variant == "duplicate":
        proto.inputs.append(proto.inputs[i])
        raw.append(raw[i])
    elif variant == "empty-name":
        proto.model_name = ""
    else:  # request parameters ([SMP-1] level 3) of every protobuf kind
        key, kind, value, expect = g.choice((
            ("temperature", "double_param", 0.5, OK), ("temperature", "string_param", "hot", frozenset({"INVALID_ARG"})),
            ("max_tokens", "int64_param", 2**40, frozenset({"INVALID_ARG"})), ("n", "int64_param", 2, frozenset({"UNSUPPORTED"})),
            ("seed", "int64_param", -1, frozenset({"INVALID_ARG"})), ("ignore_eos", "string_param", "maybe",
                                                                      frozenset({"INVALID_ARG"})),
            ("client_tag", "string_param", "x" * 3000, OK), ("logprobs", "int64_param", 30, frozenset({"INVALID_ARG"})),
            ("timeout", "int64_param", 1, OK), ("priority", "uint64_param", 2**63, OK),
        ))
        setattr(proto.parameters[key], kind, value)
    request.raw = proto
    return Case(g.index, f"proto/{variant}", "grpc_raw", [request], expect)


# ---- Triton-level garbage (HTTP) ---------------------------------------------------------------


def http_body_garbage(g: Gen) -> Case:
    """/generate and /generate_stream bodies that are no request: not JSON, not an object,
    truncated, values of no tensor kind, nesting. Nesting stays below 20k levels: tritonserver
    2.51's JSON parser overflows its stack near 200k (see the fuzz report)."""
    valid = json.dumps(g.cheap("http_generate")).encode()
    variant, body, expect = g.choice((
        ("empty", b"", TRITON_HTTP), ("not-json", b"not json", TRITON_HTTP), ("array", b"[1, 2]", TRITON_HTTP),
        ("null", b"null", TRITON_HTTP), ("number", b"42", TRITON_HTTP), ("string", b'"text"', TRITON_HTTP),
        ("truncated", valid[: g.rng.randint(1, len(valid) - 1)], TRITON_HTTP),
        ("trailing", valid + b"}", TRITON_HTTP), ("binary", bytes(g.rng.randrange(256) for _ in range(64)), TRITON_HTTP),
        ("utf16", json.dumps(g.cheap("http_generate")).encode("utf-16"), TRITON_HTTP),
        ("bom", b"\xef\xbb\xbf" + valid, TRITON_HTTP | OK),
        ("comment", valid[:-1] + b" /* c */}", TRITON_HTTP),
        ("text-list", b'{"text_input": ["a", "b"], "max_tokens": 1}', CORE),
        ("text-object", b'{"text_input": {"a": 1}, "max_tokens": 1}', TRITON_HTTP),
        ("id-number", valid[:-1] + b', "id": 5}', PARSE), ("id-null", valid[:-1] + b', "id": null}', PARSE),
        ("duplicate-input", valid[:-1] + b', "text_input": "again"}', CORE),
        ("nested-parameter", valid[:-1] + b', "deep": ' + _nest(g.choice((10, 1000, 19000))) + b"}", CORE),
        ("nested-input", b'{"text_input": "a", "max_tokens": ' + _nest(g.choice((3, 500, 19000))) + b"}",
         TRITON_HTTP),
        ("huge-key", valid[:-1] + b', "' + b"k" * 20000 + b'": "v"}', OK),
        ("no-text-input", b'{"max_tokens": 1}', CORE),
    ))
    model = g.choice(("k3_ensemble", "k3_lm"))
    if variant == "no-text-input":  # 2.51 core lets a request without the required text_input through
        expect = frozenset({"INVALID_ARG", "TRITON"})
    protocol = g.choice(("http_generate", "http_stream"))
    return Case(g.index, f"http/{variant}", protocol, [Request(model, body=body)], expect)


def _nest(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def infer_body_garbage(g: Gen) -> Case:
    """k3_vision /infer bodies that break the KServe JSON form."""
    text = {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}
    variant, obj, expect = g.choice((
        ("inputs-not-list", {"inputs": 5}, PARSE), ("no-inputs", {}, TRITON_HTTP),
        ("no-shape", {"inputs": [{k: v for k, v in text.items() if k != "shape"}]}, PARSE),
        ("shape-mismatch", {"inputs": [{**text, "shape": [1, 2]}]}, CORE),
        ("data-kind", {"inputs": [{**text, "data": [5]}]}, TRITON_HTTP),
        ("datatype", {"inputs": [{**text, "datatype": "INT32", "data": [1]}]}, CORE),
        ("unknown-datatype", {"inputs": [{**text, "datatype": "TEXT"}]}, TRITON_HTTP),
        ("pixels-negative", {"inputs": [{**text, "data": ["<|kimi_image_placeholder|>"]}, {
            "name": "image_bytes_input", "shape": [1, 1, 1, 1, 3], "datatype": "UINT8", "data": [-1, 0, 0]}]}, PARSE),
        ("pixels-float", {"inputs": [{**text, "data": ["<|kimi_image_placeholder|>"]}, {
            "name": "image_bytes_input", "shape": [1, 1, 1, 1, 3], "datatype": "UINT8", "data": [0.5, 0, 0]}]}, PARSE),
        ("unknown-output", {"inputs": [text], "outputs": [{"name": "nope"}]}, CORE),
        ("data-and-binary", {"inputs": [{**text, "parameters": {"binary_data_size": 10}}]}, CORE),
        ("batch2", {"inputs": [{**text, "shape": [2, 1], "data": ["a", "b"]}]}, frozenset({"INVALID_ARG"})),
        ("negative-shape", {"inputs": [{**text, "shape": [-1, 1]}]}, TRITON_HTTP),
        ("ok", {"inputs": [text]}, OK),
    ))
    return Case(g.index, f"infer/{variant}", "http_infer", [Request("k3_vision", body=json.dumps(obj).encode())],
                expect)


def unknown_model(g: Gen) -> Case:
    """Unknown model or version: Triton's NOT_FOUND (404)."""
    protocol = g.choice(("grpc", "http_generate", "http_stream"))
    model = g.choice(("k3_nope", "K3_LM", "k3_lm/versions/7", "", "k3_lm%00"))
    request = Request(model, g.cheap(protocol), g.rid())
    if protocol != "grpc":
        endpoint = "generate_stream" if protocol == "http_stream" else "generate"
        request.path = f"/v2/models/{model}/{endpoint}"
    return Case(g.index, f"core/unknown-model/{model}", protocol, [request], CORE)


# ---- protocol abuse ----------------------------------------------------------------------------


def _long(g: Gen, protocol: str, tokens: int, **values) -> dict:
    return {**g.cheap(protocol), "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "return_finish_reason": True, **values}


def _stop(model: str, request_id: str) -> Request:
    return Request(model, {"text_input": "", "stop": True}, request_id)


def stream_cancel(g: Gen) -> Case:
    """tritonclient stop_stream(cancel_requests=True) at a random moment of a generation; through
    the ensemble sometimes with an image, so the cancel can land while k3_vision runs ([CAN-2])."""
    model = g.model()
    values = _long(g, "grpc", g.rng.randint(8, 48), stream=g.chance(0.7))
    if model == "k3_ensemble" and g.chance(0.4):
        values.update(text_input=PLACEHOLDER + " x", image_url_input=[data_uri(encoded_image(g, "PNG"))])
    request = Request(model, values, g.rid())
    delay = g.choice((0.0, 0.001, 0.01, 0.05, 0.2, 0.5))
    return Case(g.index, f"abuse/cancel/{model}", "grpc", [request], frozenset({"ok", "dropped", "CANCELLED"}),
                action="cancel", delay_s=delay, cleanup=[_stop(model, request.request_id)])


def stream_drop(g: Gen) -> Case:
    """A raw gRPC stream that goes away (deadline) mid-generation."""
    model = g.model()
    request = Request(model, _long(g, "grpc", g.rng.randint(8, 48), stream=True), g.rid())
    request.raw = infer_request_proto(request)
    return Case(g.index, f"abuse/drop/{model}", "grpc_raw", [request], frozenset({"ok", "dropped", "CANCELLED"}),
                action="drop", delay_s=g.choice((0.005, 0.05, 0.3)), cleanup=[_stop(model, request.request_id)])


def http_abandon(g: Gen) -> Case:
    """An HTTP client that closes (or resets) its connection before the response is complete,
    or announces more body bytes than it sends."""
    model = g.model()
    protocol = g.choice(("http_generate", "http_stream"))
    request = Request(model, _long(g, protocol, g.rng.randint(8, 48)), g.rid())
    options = {"read_bytes": g.choice((0, 1, 100)), "reset": g.chance(0.5), "short_body": g.chance(0.2)}
    return Case(g.index, f"abuse/http-close/{model}", protocol, [request], frozenset({"dropped"}),
                action="abandon", options=options, cleanup=[_stop(model, request.request_id)])


def stop_race(g: Gen) -> Case:
    """[CAN-5]: a stop sent 0-5 ms after its target (or before it: a tombstone, [CAN-7]); the
    target must end `cancelled` either way."""
    model = g.model()
    protocol = g.choice(GEN_PROTOCOLS)
    rid = g.rid()
    target = Request(model, _long(g, protocol, 256), rid)
    stop = _stop(model if g.chance(0.7) else g.model(), rid)
    first_stop = g.chance(0.2)
    requests = [stop, target] if first_stop else [target, stop]
    action = "race" if protocol == "grpc" else "parallel"
    return Case(g.index, f"abuse/{'tombstone' if first_stop else 'stop-race'}/{model}", protocol, requests, OK,
                action=action, delay_s=g.choice((0.0, 0.001, 0.003, 0.005)), finish=("cancelled", 1))


def duplicate_ids(g: Gen) -> Case:
    """Requests sharing one id: each is answered; a stop for that id stops all of them ([CAN-6])."""
    model = g.model()
    protocol = g.choice(GEN_PROTOCOLS)
    rid = g.rid()
    n = g.rng.randint(2, 3)
    if g.chance(0.5):
        requests = [Request(model, g.cheap(protocol), rid) for _ in range(n)]
        return Case(g.index, f"abuse/duplicate-ids/{model}", protocol, requests, OK,
                    action="race" if protocol == "grpc" else "parallel")
    requests = [Request(model, _long(g, protocol, 256), rid) for _ in range(n)] + [_stop(model, rid)]
    # One gRPC stream keeps their order. HTTP requests go from threads 50 ms apart, and under load a target
    # can arrive after the stop, which matched the others and so left no tombstone: it runs to its end
    # ([CAN-7]; the soak saw it once in 18,219 cases). One is always cancelled, matched or by the tombstone.
    return Case(g.index, f"abuse/duplicate-ids-stopped/{model}", protocol, requests, OK,
                action="race" if protocol == "grpc" else "parallel", delay_s=0.05,
                finish=("cancelled", n if protocol == "grpc" else 1))


def request_ids(g: Gen) -> Case:
    """Odd but valid request ids (long, non-ASCII, NUL, whitespace) on requests and stops."""
    rid = g.choice(("x" * g.choice((1000, 65536)), "\u00e9\u4e2d\U0001f600", "a\x00b", " ", "line\nbreak", "'\"{}"))
    rid = f"{rid}-{g.rid()}"
    model, protocol = g.model(), g.choice(GEN_PROTOCOLS)
    values = {"text_input": "", "stop": True} if g.chance(0.5) else g.cheap(protocol)
    return g.case("ids/odd", OK, values, model=model, protocol=protocol, request_id=rid)


def burst(g: Gen) -> Case:
    """8-24 requests pipelined on one stream, some invalid, the stream cancelled at a random moment."""
    model = g.model()
    requests = [Request(model, g.cheap("grpc", **({"top_p": 5.0} if g.chance(0.3) else {})), g.rid())
                for _ in range(g.rng.randint(8, 24))]
    return Case(g.index, f"abuse/burst/{model}", "grpc", requests,
                frozenset({"ok", "INVALID_ARG", "dropped", "CANCELLED"}), action="cancel",
                delay_s=g.choice((0.0, 0.02, 0.1, 0.3)), cleanup=[_stop(model, r.request_id) for r in requests[:2]])


def http_id_utf8(g: Gen) -> Case:
    """A /generate or /infer "id" that is not UTF-8: Python's request.request_id() raises."""
    rid = g.choice((b"\xff\xfe", b"\xed\xa0\x80", b"ok\xc0"))
    model = g.choice(ANY_MODEL)
    if model == "k3_vision":
        body = b'{"id": "' + rid + b'", "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", ' \
               b'"data": ["hi"]}]}'
        return Case(g.index, "abuse/http-id-utf8/k3_vision", "http_infer", [Request(model, body=body)],
                    frozenset({"INVALID_ARG", "TRITON"}))
    values = {"text_input": "", "stop": True} if g.chance(0.3) else g.cheap("http_generate")
    return Case(g.index, f"abuse/http-id-utf8/{model}", "http_generate", [Request(model, values, rid)],
                frozenset({"INVALID_ARG", "TRITON"}))


def http_parameter_utf8(g: Gen) -> Case:
    """A /generate body key that becomes a request parameter, with a name or value that is not
    UTF-8 (raw bytes or a lone-surrogate escape): Python's request.parameters() raises."""
    model = g.model()
    key, value = g.choice(((b"client_tag", b"\xff"), (b"\xff", b"x"), (b"temperature\xfe", b"1"),
                           (b"client_tag", b"\\udc80")))
    body = json_bytes(g.cheap("http_generate"))[:-1] + b', "' + key + b'": "' + value + b'"}'
    return Case(g.index, f"abuse/http-parameter-utf8/{model}", "http_generate", [Request(model, body=body)],
                frozenset({"ok", "INVALID_ARG"}))


def overstated_bytes_length(g: Gen) -> Case:
    """A BYTES length prefix larger than its data. Core passes it (it checks only that the prefix
    is complete); the 2.51 Python backend refuses it when it reads the batch, and fails every
    request of that k3_vision dynamic batch with this request's error. Its own answer is fine;
    the harm is to the requests batched with it (text-only ensemble requests included)."""
    model = g.choice(("k3_ensemble", "k3_vision"))
    request = Request(model, {"text_input": g.text()} if model == "k3_vision" else g.cheap("grpc"), g.rid())
    return Case(g.index, f"known/overstated-bytes-length/{model}", "grpc_raw", [overstate_bytes_length(request)],
                CORE)


def overstate_bytes_length(request: Request) -> Request:
    """`request` with the raw protobuf whose text_input length prefix claims 65535 bytes."""
    proto = infer_request_proto(request)
    i = [t.name for t in proto.inputs].index("text_input")
    proto.raw_input_contents[i] = b"\xff\xff\x00\x00" + proto.raw_input_contents[i][4:]
    request.raw = proto
    return request


# ---- a Triton 2.51 defect: out of the default mix (see test_fuzz.py) ----------------------------
# Harm to other requests (its k3_vision batch); test_fuzz pins it with a strict xfail.
BATCH_POISON = [(overstated_bytes_length, 1)]
CLASSES = [(http_id_utf8, 1), (http_parameter_utf8, 1), (request_ids, 2), (burst, 2), (unknown_input, 4), (wrong_dtype, 4), (wrong_shape, 3), (batch_size, 3), (empty_tensor, 3),
           (broken_proto, 5), (http_body_garbage, 5), (infer_body_garbage, 3), (unknown_model, 2),
           (stream_cancel, 3), (stream_drop, 2), (http_abandon, 3), (stop_race, 3), (duplicate_ids, 2)]
