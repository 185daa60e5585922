"""k3_vision (SERVING.md §3): VisionServer in-process, then the real tritonserver end to end.

The end-to-end part serves a copy of model_repository/k3_vision alone (so nothing else in the
repository can break it), with `model_path` pointed at a tiny checkpoint made once per module.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf import json_format, text_format
from PIL import Image
from tritonclient.grpc import model_config_pb2

from k3backend.config import ConfigError
from k3backend.errors import K3Error
from k3backend.model.preprocess import PreprocessConfig, grid_for_size, image_num_tokens
from k3backend.presets import make_checkpoint
from k3backend.serving.vision_adapter import OUTPUTS, PARAMETERS, VisionParams, VisionRequest, VisionServer
from fake_pb import FakePbUtils

REPO_CONFIG = Path(__file__).resolve().parents[1] / "model_repository" / "k3_vision" / "config.pbtxt"
PH = "<|kimi_image_placeholder|>"
CANNOT_DECODE = "k3_vision: INVALID_ARG: image 0: cannot decode image data (PNG, JPEG, WebP, GIF or BMP expected)"


def model_config(**params: str) -> dict[str, Any]:
    """config.pbtxt as Triton hands it to `initialize` (JSON of the ModelConfig proto)."""
    proto = text_format.Parse(REPO_CONFIG.read_text(), model_config_pb2.ModelConfig())
    cfg = json_format.MessageToDict(proto, preserving_proto_field_name=True)
    for k, v in params.items():
        cfg["parameters"][k] = {"string_value": v}
    return cfg


def png(w: int, h: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def b64(w: int, h: int, seed: int = 0) -> bytes:
    return base64.b64encode(png(w, h, seed))


def solid_png(w: int, h: int) -> bytes:
    """A large image that compresses to a small file (a 9000x9000 one is about 250 kB)."""
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 120, 40)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("k3_vision_ckpt") / "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[VisionServer]:
    threads = torch.get_num_threads()  # VisionServer sets the CPU thread share of its instance
    try:
        s = VisionServer.from_model_config(model_config(model_path=str(checkpoint)))
    finally:
        torch.set_num_threads(threads)
    yield s
    s.close()


# ---- config.pbtxt and parameters ([CFG-V1], [CFG-V2], §3.2-§3.4) ------------------------------


def test_config_pbtxt_declares_the_contract() -> None:
    cfg = model_config()
    assert cfg["backend"] == "python" and cfg["max_batch_size"] == 16
    assert "model_transaction_policy" not in cfg  # not decoupled
    assert cfg["dynamic_batching"].get("max_queue_delay_microseconds", "0") in (0, "0")
    assert cfg["instance_group"] == [{"count": 2, "kind": "KIND_MODEL"}]
    inputs = {i["name"]: (i["data_type"], [int(d) for d in i["dims"]], i.get("optional", False),
                          i.get("allow_ragged_batch", False)) for i in cfg["input"]}
    assert inputs == {
        "text_input": ("TYPE_STRING", [1], False, False),
        "messages": ("TYPE_STRING", [1], True, False),
        "image_url_input": ("TYPE_STRING", [-1], True, True),
        "image": ("TYPE_STRING", [-1], True, True),
        "image_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1], True, True),
        "stop": ("TYPE_BOOL", [1], True, False),  # [CAN-3]: declared as k3_lm's, mapped by the ensemble
    }
    outputs = {o["name"]: (o["data_type"], [int(d) for d in o["dims"]]) for o in cfg["output"]}
    assert outputs == {
        "image_embeds": ("TYPE_BF16", [-1, -1]), "image_token_counts": ("TYPE_INT32", [-1]),
        "image_grid_thw": ("TYPE_INT64", [-1, 3]), "image_sizes": ("TYPE_INT32", [-1, 2]),
        "image_hashes": ("TYPE_STRING", [-1]),
    }
    assert {k: v.get("string_value", "") for k, v in cfg["parameters"].items()} == PARAMETERS


def test_parameter_defaults() -> None:
    p = VisionParams.from_model_config(model_config())
    assert (p.model_path, p.device, p.gpu_device_id, p.dtype) == ("", "auto", 0, "auto")
    assert (p.limits.max_images_per_request, p.limits.max_image_bytes, p.limits.max_total_image_bytes,
            p.limits.max_image_pixels) == (16, 33554432, 134217728, 89478485)
    assert p.max_image_tokens_per_request == 32768
    assert p.in_patch_limit is None and p.patch_limit_on_one_side is None
    assert p.url_policy.allow_remote is False and p.url_policy.allow_private is False
    assert p.url_policy.allowlist == () and p.url_policy.timeout_s == 10
    assert p.report_metrics is True and p.metrics_prefix == "k3"
    p = VisionParams.from_model_config(model_config(remote_image_url_allowlist=" A.example.com, b.example.org ",
                                                    in_patch_limit="1024", allow_remote_image_urls="TRUE"))
    assert p.url_policy.allowlist == ("a.example.com", "b.example.org")
    assert p.in_patch_limit == 1024 and p.url_policy.allow_remote


def test_unknown_parameter_fails_the_load_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['max_image_byte'\]"):
        VisionParams.from_model_config(model_config(max_image_byte="1"))


@pytest.mark.parametrize("name,value", [
    ("max_image_bytes", "lots"), ("max_images_per_request", "0"), ("allow_remote_image_urls", "maybe"),
    ("url_fetch_timeout_s", "-1"), ("device", "tpu"), ("dtype", "int8"), ("gpu_device_ids", "0,1"),
    ("patch_limit_on_one_side", "1024"), ("in_patch_limit", "x"), ("REPORT_CUSTOM_METRICS", ""),
])
def test_unparsable_parameter_fails_the_load_naming_it(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^k3_vision: parameter {name}: expected .*, got {re.escape(repr(value))}$"):
        VisionParams.from_model_config(model_config(**{name: value}))


def test_embeddings_take_the_declared_dtype(checkpoint: Path) -> None:
    cfg = model_config(model_path=str(checkpoint))
    next(o for o in cfg["output"] if o["name"] == "image_embeds")["data_type"] = "TYPE_FP32"  # [ENS-3]
    threads = torch.get_num_threads()
    s = VisionServer.from_model_config(cfg)
    torch.set_num_threads(threads)
    (out,) = s.execute([VisionRequest(text_input=PH.encode(), image=[b64(30, 30)])])
    assert out["image_embeds"].dtype == torch.float32
    cfg["output"][0]["data_type"] = "TYPE_FP16"
    with pytest.raises(ConfigError, match="output image_embeds: data_type must be one of"):
        VisionServer.from_model_config(cfg)


# ---- VisionServer.execute in-process --------------------------------------------------------------


def check_outputs(out: dict[str, Any], sizes: list[tuple[int, int]], cfg: PreprocessConfig | None = None) -> None:
    """[VIS-2] and agreement with the preprocessing rules, in wire shapes (batch dim 1)."""
    cfg = cfg or PreprocessConfig()
    assert set(out) == set(OUTPUTS)
    counts = np.asarray(out["image_token_counts"]).reshape(-1)
    grids = np.asarray(out["image_grid_thw"]).reshape(-1, 3)
    n = len(sizes)
    assert len(counts) == len(grids) == np.asarray(out["image_sizes"]).reshape(-1, 2).shape[0] == n
    assert np.asarray(out["image_hashes"]).reshape(-1).shape == (n,)
    assert list(np.asarray(out["image_sizes"]).reshape(-1, 2).tolist()) == [list(s) for s in sizes]
    assert [tuple(g) for g in grids.tolist()] == [grid_for_size(w, h, cfg) for w, h in sizes]
    assert counts.tolist() == [image_num_tokens(w, h, cfg) for w, h in sizes]
    assert (counts == grids[:, 1] * grids[:, 2] // 4).all()
    assert out["image_embeds"].shape[:2] == (1, counts.sum())
    for h in np.asarray(out["image_hashes"]).reshape(-1):
        h = h.decode() if isinstance(h, bytes) else h
        assert re.fullmatch(r"[0-9a-f]{32}", h)


def test_text_only_request_has_no_outputs(server: VisionServer) -> None:  # [VIS-1]
    chat = b'[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]'
    requests = [VisionRequest(text_input=b"hello"), VisionRequest(text_input=b"", messages=chat)]
    assert server.execute(requests) == [{}, {}]


def test_every_image_input_kind(server: VisionServer) -> None:
    data_uri = b"data:image/png;base64," + b64(40, 30)
    pixels = np.random.default_rng(3).integers(0, 256, (2, 20, 50, 3), dtype=np.uint8)
    messages = (b'[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "' + data_uri +
                b'"}}, {"type": "text", "text": "what?"}, {"type": "image", "image": "' + b64(16, 16) + b'"}]}]')
    results = server.execute([
        VisionRequest(text_input=f"a {PH} b".encode(), image=[b64(40, 30)]),
        VisionRequest(text_input=PH.encode(), image_url_input=[data_uri]),
        VisionRequest(text_input=(PH * 2).encode(), image_bytes_input=pixels),
        VisionRequest(text_input=b"", messages=messages),
        VisionRequest(text_input=b"", messages=b'[{"role": "user", "content": [{"type": "image"}]}]',
                      image=[b64(9, 9)]),
    ])
    for out, sizes in zip(results, [[(40, 30)], [(40, 30)], [(50, 20)] * 2, [(40, 30), (16, 16)], [(9, 9)]]):
        check_outputs(out, sizes)
    assert torch.equal(results[0]["image_embeds"], results[1]["image_embeds"])  # same file, two routes
    assert results[0]["image_hashes"][0, 0] == results[3]["image_hashes"][0, 0]


@pytest.mark.parametrize("request_,message", [
    (VisionRequest(text_input=(PH * 2).encode(), image=[b64(8, 8)]),
     "the prompt has 2 image placeholders but 1 image was supplied"),
    (VisionRequest(text_input=b"no placeholder", image=[b64(8, 8)]),
     "the prompt has 0 image placeholders but 1 image was supplied"),
    (VisionRequest(text_input=PH.encode()), "the prompt has 1 image placeholder but 0 images were supplied"),
    (VisionRequest(text_input=PH.encode(), image=[b"bm90IGFuIGltYWdl"]), CANNOT_DECODE.split(": ", 2)[2]),
    (VisionRequest(text_input=PH.encode(), image=[b64(8, 8)], image_url_input=[b"data:image/png;base64,AA"]),
     "use only one of image_url_input, image, image_bytes_input"),
    (VisionRequest(text_input=b"\xff" + PH.encode(), image=[b64(8, 8)]), "text_input is not valid UTF-8 at byte 0"),
    (VisionRequest(text_input=PH.encode(), image=[b64(8, 8)], batch_size=2),
     "one prompt per request: expected batch size 1, got 2"),
])
def test_client_errors_are_invalid_arg(server: VisionServer, request_: VisionRequest, message: str) -> None:
    (err,) = server.execute([request_])
    assert isinstance(err, K3Error) and err.code == "INVALID_ARG"
    assert str(err) == message


NO_TOWER = "this checkpoint has no vision tower ({}): it serves text only"


def text_only_checkpoint(out: Path, kind: str) -> Path:
    """kimi_linear: the text-only layout; kimi_k3: the tiny checkpoint with its vision_config removed."""
    if kind == "kimi_linear":
        return make_checkpoint("tiny", out, text_only=True)
    make_checkpoint("tiny", out)
    raw = json.loads((out / "config.json").read_text())
    del raw["vision_config"]
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("kind,what", [("kimi_linear", "model_type kimi_linear"),
                                       ("kimi_k3", "model_type kimi_k3, no vision_config")],
                         ids=["kimi_linear", "kimi_k3-without-vision_config"])
def test_a_checkpoint_without_a_tower_serves_text_and_refuses_images(tmp_path, caplog, kind, what) -> None:
    """k3_vision loads without a tower (so k3_ensemble serves text-only checkpoints): text-only and
    stop requests have no outputs as always; every request with images or placeholders is INVALID_ARG."""
    ckpt = text_only_checkpoint(tmp_path / kind, kind)
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="k3backend.serving.vision_adapter"):
        s = VisionServer.from_model_config(model_config(model_path=str(ckpt)))
        s.warm_up()
    torch.set_num_threads(threads)
    assert s.model is None and f"k3_vision: loaded without a vision tower (checkpoint {ckpt}, {what})" in caplog.text
    data_uri = b"data:image/png;base64," + b64(40, 30)
    chat = b'[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "' + data_uri + b'"}}]}]'
    images = [VisionRequest(text_input=f"a {PH} b".encode(), image=[b64(40, 30)]),
              VisionRequest(text_input=PH.encode(), image_url_input=[data_uri]),
              VisionRequest(text_input=b"no placeholder", image=[b64(8, 8)]),
              VisionRequest(text_input=PH.encode()),
              VisionRequest(text_input=b"", messages=chat)]
    results = s.execute([VisionRequest(text_input=b"hello"), VisionRequest(image=[b"x"], stop=True), *images])
    assert results[:2] == [{}, {}]
    for err in results[2:]:
        assert isinstance(err, K3Error) and err.code == "INVALID_ARG" and str(err) == NO_TOWER.format(what), err
    s.close()


def test_token_limit_checked_before_the_tower(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    s = VisionServer.from_model_config(model_config(model_path=str(checkpoint), max_image_tokens_per_request="20"))
    torch.set_num_threads(threads)
    calls = []
    monkeypatch.setattr(s, "_encode", lambda processed: calls.append(processed))
    (err,) = s.execute([VisionRequest(text_input=(PH * 2).encode(), image=[b64(100, 100), b64(60, 60)])])
    need = image_num_tokens(100, 100, PreprocessConfig()) + image_num_tokens(60, 60, PreprocessConfig())
    assert need > 20
    assert str(err) == f"the images need {need} tokens, more than max_image_tokens_per_request 20"
    assert calls == []


def test_stop_request_has_no_outputs_whatever_its_other_inputs(server: VisionServer) -> None:  # [CAN-3]
    stop = VisionRequest(text_input=b"\xff not UTF-8", messages=b"{not json", image=[b"not base64!"],
                         image_url_input=[b"ftp://x"], batch_size=3, stop=True)
    text = VisionRequest(text_input=b"hello")
    assert server.execute([stop, text]) == [{}, {}]


def test_decoded_images_are_released_one_by_one(server: VisionServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoded frame is closed once preprocessed, before the next is decoded: a request holds
    at most one decoded image at a time, not all of them."""
    from k3backend.serving import vision_adapter

    seen: list[Image.Image] = []
    real = vision_adapter.preprocess_image

    def spy(image: Image.Image, cfg: PreprocessConfig):
        for earlier in seen:
            with pytest.raises(ValueError, match="closed image"):
                earlier.getpixel((0, 0))
        seen.append(image)
        return real(image, cfg)

    monkeypatch.setattr(vision_adapter, "preprocess_image", spy)
    (out,) = server.execute([VisionRequest(text_input=(PH * 3).encode(), image=[b64(30, 20, i) for i in range(3)])])
    check_outputs(out, [(30, 20)] * 3)
    assert len(seen) == 3
    with pytest.raises(ValueError, match="closed image"):
        seen[-1].getpixel((0, 0))


def test_heap_is_trimmed_after_a_batch_with_large_images(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose images held >= TRIM_AFTER_BYTES on the host gives the freed heap back; small ones do not."""
    from k3backend.serving import vision_adapter

    threads = torch.get_num_threads()
    s = VisionServer.from_model_config(model_config(model_path=str(checkpoint), in_patch_limit="256"))
    torch.set_num_threads(threads)
    trims: list[bool] = []
    monkeypatch.setattr(vision_adapter, "release_free_heap", lambda: trims.append(True) or True)
    side = 2 + int((vision_adapter.TRIM_AFTER_BYTES / 4) ** 0.5)  # its decoded frame alone is over the threshold
    big = base64.b64encode(solid_png(side, side))
    (out,) = s.execute([VisionRequest(text_input=PH.encode(), image=[b64(40, 40)])])
    check_outputs(out, [(40, 40)])
    assert trims == []
    (out,) = s.execute([VisionRequest(text_input=PH.encode(), image=[big])])
    check_outputs(out, [(side, side)], PreprocessConfig(in_patch_limit=256))
    assert trims == [True]
    s.close()


def test_errors_are_per_request_and_defects_are_internal(server: VisionServer, monkeypatch: pytest.MonkeyPatch) -> None:
    good = VisionRequest(text_input=PH.encode(), image=[b64(30, 20)], request_id="good")
    (alone,) = server.execute([good])
    real = server._prepare

    def flaky(request: VisionRequest):
        if request.request_id == "defect":
            raise RuntimeError("boom")
        return real(request)

    monkeypatch.setattr(server, "_prepare", flaky)
    results = server.execute([VisionRequest(text_input=PH.encode(), image=[b"AAAA"]),
                              VisionRequest(text_input=b"x", request_id="defect"), good])
    assert results[0].code == "INVALID_ARG"
    assert results[1].code == "INTERNAL"
    assert str(results[1]) == "unexpected error (see server log, request id 'defect')"
    assert torch.equal(results[2]["image_embeds"], alone["image_embeds"])


def test_results_do_not_depend_on_the_batch(server: VisionServer) -> None:  # [VIS-8]
    # 14x14 gives 1 token: the size where a packed CPU projector GEMM differs in the last bit.
    reqs = [VisionRequest(text_input=(PH * len(imgs)).encode(), image=imgs) for imgs in (
        [b64(14, 14, 1)], [b64(90, 60, 2), b64(28, 28, 3)], [b64(200, 120, 4)], [b64(14, 14, 1), b64(40, 40, 5)])]
    alone = [server.execute([r])[0] for r in reqs]
    batched = server.execute(reqs[::-1])[::-1]
    for a, b in zip(alone, batched):
        assert torch.equal(a["image_embeds"], b["image_embeds"])
        assert (a["image_hashes"] == b["image_hashes"]).all()
    assert torch.equal(alone[0]["image_embeds"][0], alone[3]["image_embeds"][0, :1])
    assert alone[0]["image_hashes"][0, 0] == alone[3]["image_hashes"][0, 0]


# ---- Triton glue with a stand-in pb_utils ------------------------------------------------------

def _args(checkpoint: Path, **params: str) -> dict[str, Any]:
    import json

    return {"model_config": json.dumps(model_config(model_path=str(checkpoint), **params)), "model_name": "k3_vision",
            "model_version": "1", "model_instance_device_id": "0", "model_instance_name": "k3_vision_0_0"}


def _wire(text: str, **images: Any) -> dict[str, np.ndarray]:
    arrays = {"text_input": np.array([[text.encode()]], dtype=object)}
    for name, value in images.items():
        arrays[name] = value[None] if name == "image_bytes_input" else np.array([value], dtype=object)
    return arrays


@pytest.fixture
def glue_server(checkpoint: Path):
    from k3backend.serving.vision_adapter import triton_initialize

    FakePbUtils.MetricFamily.created = []
    threads = torch.get_num_threads()
    s = triton_initialize(FakePbUtils, _args(checkpoint))
    torch.set_num_threads(threads)
    yield s
    s.close()


def test_triton_execute_maps_every_outcome_and_never_raises(glue_server: VisionServer) -> None:  # [VIS-7]
    from k3backend.serving.vision_adapter import triton_execute

    def broken() -> np.ndarray:
        raise RuntimeError("tensor went away")

    requests = [
        FakePbUtils.Request(_wire("text only")),
        FakePbUtils.Request(_wire(PH, image=[b64(30, 20)])),
        FakePbUtils.Request(_wire(PH, image=[b"AAAA"])),
        FakePbUtils.Request({"text_input": broken}, request_id="r-broken"),
        FakePbUtils.Request({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}),
    ]
    responses = triton_execute(FakePbUtils, glue_server, requests)
    assert len(responses) == 5
    assert responses[0].output_tensors == [] and responses[0].error is None
    tensors = {t.name: t.value for t in responses[1].output_tensors}
    assert list(tensors) == list(OUTPUTS) and tensors["image_embeds"].dtype == torch.bfloat16
    check_outputs(tensors, [(30, 20)])
    assert (responses[2].error.code, responses[2].error.message) == (FakePbUtils.TritonError.INVALID_ARG, CANNOT_DECODE)
    assert responses[3].error.code == FakePbUtils.TritonError.INTERNAL
    assert responses[3].error.message == "k3_vision: INTERNAL: unexpected error (see server log, request id 'r-broken')"
    assert responses[4].error.message == "k3_vision: INVALID_ARG: one prompt per request: expected batch size 1, got 2"


def test_triton_stop_request_reads_no_other_input(glue_server: VisionServer) -> None:  # [CAN-3]
    from k3backend.serving.vision_adapter import triton_execute

    def untouchable() -> np.ndarray:
        raise AssertionError("a stop request's other inputs must not be read")

    stop = FakePbUtils.Request({"stop": np.array([[True]]), "text_input": untouchable, "image": untouchable})
    not_stop = FakePbUtils.Request({**_wire(PH, image=[b64(30, 20)]), "stop": np.array([[False]])})
    responses = triton_execute(FakePbUtils, glue_server, [stop, not_stop])
    assert responses[0].output_tensors == [] and responses[0].error is None
    assert responses[1].error is None
    check_outputs({t.name: t.value for t in responses[1].output_tensors}, [(30, 20)])


def test_metric_families_and_updates(checkpoint: Path) -> None:  # SERVING.md §9, [MET-1], [MET-2]
    from k3backend.serving.metrics import TTFT_BUCKETS, TritonMetrics
    from k3backend.serving.vision_adapter import triton_execute, triton_initialize

    FakePbUtils.MetricFamily.created = []
    threads = torch.get_num_threads()
    s = triton_initialize(FakePbUtils, _args(checkpoint, metrics_prefix="vllm"))
    torch.set_num_threads(threads)
    assert sorted(FakePbUtils.MetricFamily.created) == [
        ("vllm:request_failure_total", "counter"), ("vllm:vision_encode_seconds", "histogram"),
        ("vllm:vision_images_total", "counter")]
    metrics: TritonMetrics = s.metrics
    series = dict(metrics._series)
    triton_execute(FakePbUtils, s, [FakePbUtils.Request(_wire(PH * 2, image=[b64(20, 20), b64(30, 30)])),
                                    FakePbUtils.Request(_wire(PH, image=[b"AAAA"]))])
    s.close()
    assert series[("vision_images_total", ())].values == [2.0]
    assert series[("vision_images_total", ())].labels == {"model": "k3_vision", "version": "1"}
    assert series[("request_failure_total", (("code", "INVALID_ARG"),))].values == [1.0]
    assert series[("request_failure_total", (("code", "INTERNAL"),))].values == []
    encode = series[("vision_encode_seconds", ())]
    assert encode.buckets == list(TTFT_BUCKETS) and len(encode.values) == 1 and encode.values[0] > 0


def test_metrics_off_registers_nothing(checkpoint: Path) -> None:  # [MET-3]
    from k3backend.serving.metrics import NullMetrics
    from k3backend.serving.vision_adapter import triton_initialize

    FakePbUtils.MetricFamily.created = []
    threads = torch.get_num_threads()
    s = triton_initialize(FakePbUtils, _args(checkpoint, REPORT_CUSTOM_METRICS="false"))
    torch.set_num_threads(threads)
    assert type(s.metrics) is NullMetrics and FakePbUtils.MetricFamily.created == []
    s.close()


# ---- the real tritonserver ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton(triton_server, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("k3_vision_repo")
    shutil.copytree(REPO_CONFIG.parent, repo / "k3_vision", ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / "k3_vision" / "config.pbtxt"
    text, n = re.subn(r'(key: "model_path" value: \{ string_value: )""', rf'\1"{checkpoint}"', config.read_text())
    assert n == 1
    config.write_text(text)
    return triton_server(repo, ["k3_vision"])


@pytest.fixture(scope="module")
def grpc(triton):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(triton):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url.removeprefix("http://"), concurrency=2)
    yield client
    client.close()


def _inputs(module: Any, text: str, **images: Any) -> list[Any]:
    """Wire shapes: [1, 1] for text, [1, n] for lists, [1, N, H, W, C] for pixels (SERVING.md §0)."""
    arrays = {"text_input": ("BYTES", np.array([[text.encode()]], dtype=object))}
    for name, value in images.items():
        if name == "image_bytes_input":
            arrays[name] = ("UINT8", value[None])
        else:
            arrays[name] = ("BYTES", np.array([value], dtype=object))
    out = []
    for name, (dtype, arr) in arrays.items():
        tensor = module.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _grpc_infer(grpc, text: str, **images: Any):
    import tritonclient.grpc as grpcclient

    return grpc.infer("k3_vision", _inputs(grpcclient, text, **images))


def _as_outputs(result) -> dict[str, np.ndarray]:
    return {name: result.as_numpy(name) for name in OUTPUTS}


def _bits(embeds: np.ndarray) -> np.ndarray:
    assert embeds.dtype.itemsize == 2  # BF16 on the wire
    return embeds.view(np.uint16)


def test_e2e_text_only_request_has_no_outputs(grpc, http) -> None:  # [VIS-1], [TOP-4]
    import tritonclient.http as httpclient

    assert list(_grpc_infer(grpc, "just text").get_response().outputs) == []
    assert http.infer("k3_vision", _inputs(httpclient, "just text")).get_response()["outputs"] == []


def test_e2e_image_base64_over_grpc_and_http(grpc, http, server: VisionServer) -> None:
    import tritonclient.http as httpclient

    image = [b64(60, 40, 7)]
    g = _as_outputs(_grpc_infer(grpc, f"describe {PH}", image=image))
    h = _as_outputs(http.infer("k3_vision", _inputs(httpclient, f"describe {PH}", image=image)))
    check_outputs(g, [(60, 40)])
    assert np.array_equal(_bits(g["image_embeds"]), _bits(h["image_embeds"]))
    for name in OUTPUTS[1:]:
        assert np.array_equal(g[name], h[name])
    # Same numbers as the in-process server (the instance may use another CPU thread count).
    (ref,) = server.execute([VisionRequest(text_input=PH.encode(), image=image)])
    assert g["image_hashes"][0, 0] == ref["image_hashes"][0, 0]
    torch.testing.assert_close(torch.from_numpy(g["image_embeds"].astype(np.float32)),
                               ref["image_embeds"].float(), rtol=1e-2, atol=1e-2)


def test_e2e_image_url_data_uri_and_image_bytes_input(grpc) -> None:
    out = _as_outputs(_grpc_infer(grpc, PH, image_url_input=[b"data:image/png;base64," + b64(33, 47)]))
    check_outputs(out, [(33, 47)])
    pixels = np.random.default_rng(9).integers(0, 256, (2, 30, 70, 3), dtype=np.uint8)
    out = _as_outputs(_grpc_infer(grpc, PH + " and " + PH, image_bytes_input=pixels))
    check_outputs(out, [(70, 30), (70, 30)])


def test_e2e_bad_image_is_invalid_arg_and_server_keeps_serving(grpc, http) -> None:  # [VIS-7]
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        _grpc_infer(grpc, PH, image=[base64.b64encode(b"definitely not a picture")])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == CANNOT_DECODE
    with pytest.raises(InferenceServerException) as e:
        http.infer("k3_vision", _inputs(httpclient, PH, image=[base64.b64encode(b"GIF89a broken")]))
    assert e.value.status() == "400" and e.value.message() == CANNOT_DECODE
    check_outputs(_as_outputs(_grpc_infer(grpc, PH, image=[b64(20, 20)])), [(20, 20)])


def test_e2e_placeholder_mismatch_is_invalid_arg(grpc) -> None:  # [VIS-6]
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        _grpc_infer(grpc, PH + PH, image=[b64(20, 20)])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == "k3_vision: INVALID_ARG: the prompt has 2 image placeholders but 1 image was supplied"


def test_e2e_batched_requests_are_independent(grpc) -> None:  # [CFG-V2], [VIS-7], [VIS-8]
    import tritonclient.grpc as grpcclient

    cases = [[b64(20 + 7 * i, 30, i)] * (1 + i % 3) for i in range(12)]
    cases[5] = [b64(20, 20), base64.b64encode(b"broken")]  # one bad request in the crowd
    alone = []
    for imgs in cases:
        try:
            alone.append(_as_outputs(_grpc_infer(grpc, PH * len(imgs), image=imgs)))
        except Exception as e:
            alone.append(e)
    before = _batched_executions(grpc)
    done, lock, results = threading.Event(), threading.Lock(), {}

    def callback(i: int):
        def cb(result, error) -> None:
            with lock:
                results[i] = error if error is not None else _as_outputs(result)
                if len(results) == len(cases) * 2:
                    done.set()
        return cb

    for rep in range(2):
        for i, imgs in enumerate(cases):
            grpc.async_infer("k3_vision", _inputs(grpcclient, PH * len(imgs), image=imgs),
                             callback(i + rep * len(cases)))
    assert done.wait(30)
    for k, got in results.items():
        want = alone[k % len(cases)]
        if k % len(cases) == 5:
            assert str(want) == str(got) and CANNOT_DECODE.replace("image 0", "image 1") in str(got)
            continue
        assert np.array_equal(_bits(got["image_embeds"]), _bits(want["image_embeds"]))
        for name in OUTPUTS[1:]:
            assert np.array_equal(got[name], want[name])
    assert _batched_executions(grpc) > before  # some requests really shared an execute call


def _batched_executions(grpc) -> int:
    stats = grpc.get_inference_statistics("k3_vision", as_json=True)["model_stats"][0]
    return sum(int(b["compute_infer"].get("count", 0)) for b in stats.get("batch_stats", [])
               if int(b["batch_size"]) > 1)


def test_e2e_metrics(grpc, triton) -> None:  # SERVING.md §9
    from tritonclient.utils import InferenceServerException

    _grpc_infer(grpc, PH, image=[b64(25, 25)])
    with pytest.raises(InferenceServerException):
        _grpc_infer(grpc, PH)
    deadline, text = time.monotonic() + 10, ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(triton.metrics_url, timeout=5).read().decode()
        if 'k3:request_failure_total{code="INVALID_ARG"' in text and "k3:vision_encode_seconds_count" in text:
            break
        time.sleep(0.2)
    labels = 'model="k3_vision",version="1"'

    def value(pattern: str) -> float:
        m = re.search(pattern + r" ([0-9.e+]+)$", text, re.M)
        assert m, f"{pattern} not in metrics:\n{text}"
        return float(m.group(1))

    assert value(rf"k3:vision_images_total\{{{labels}\}}") >= 1
    assert value(rf"k3:vision_encode_seconds_count\{{{labels}\}}") >= 1
    assert value(rf'k3:vision_encode_seconds_bucket\{{{labels},le="80"\}}') >= 1
    assert value(rf'k3:request_failure_total\{{code="INVALID_ARG",{labels}\}}') >= 1
    assert value(rf'k3:request_failure_total\{{code="INTERNAL",{labels}\}}') == 0
    assert "# TYPE k3:vision_encode_seconds histogram" in text


# ---- large images: bounded memory, limits named ([ERR-3], SERVING.md §3.4) ------------------------


def _stub_rss(triton) -> int:
    """Summed RSS of the k3_vision Python-backend stubs (both instances) of this server."""
    from k3backend.serving.heap import rss_bytes

    total, found = 0, 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
            if ppid == triton.pid and b"triton_python_backend_stub" in cmdline and b"k3_vision" in cmdline:
                total, found = total + rss_bytes(proc.name), found + 1
        except (OSError, IndexError, ValueError):  # the process went away meanwhile
            continue
    assert found == 2, f"expected the 2 k3_vision stubs of tritonserver pid {triton.pid}, found {found}"
    return total


def test_e2e_9000x9000_image_is_encoded_and_memory_returns(grpc, triton) -> None:  # [ERR-3]
    """Under max_image_pixels, so it must be encoded (it was INTERNAL: attention asked for ~35 GB).
    Afterwards, and after two more large images, the stubs' RSS is back near where it was."""
    for _ in range(2):  # both instances have served an image: the baseline is warm
        check_outputs(_as_outputs(_grpc_infer(grpc, PH, image=[b64(300, 200)])), [(300, 200)])
    before = _stub_rss(triton)
    start = time.perf_counter()
    out = _as_outputs(_grpc_infer(grpc, PH, image=[base64.b64encode(solid_png(9000, 9000))]))
    took = time.perf_counter() - start
    check_outputs(out, [(9000, 9000)])
    assert grid_for_size(9000, 9000, PreprocessConfig()) == (1, 258, 258)  # what the tower got: 66564 patches
    after_one = _stub_rss(triton)
    for side in (2400, 2600):
        check_outputs(_as_outputs(_grpc_infer(grpc, PH, image=[base64.b64encode(solid_png(side, side))])),
                      [(side, side)])
    after = _stub_rss(triton)
    print(f"\nk3_vision stubs RSS: {before / 2**20:.0f} MiB before, {after_one / 2**20:.0f} MiB after the "
          f"9000x9000 image ({took:.1f} s), {after / 2**20:.0f} MiB after two more large images")
    assert after - before < 64 << 20, f"RSS grew from {before / 2**20:.0f} to {after / 2**20:.0f} MiB"


def test_e2e_too_many_image_tokens_is_invalid_arg_naming_the_limit(grpc) -> None:
    """Three 9000x9000 images: each passes the per-image limits, together they need more tokens than
    max_image_tokens_per_request; refused from the headers, before any pixel is decoded."""
    from tritonclient.utils import InferenceServerException

    image = base64.b64encode(solid_png(9000, 9000))
    need = 3 * image_num_tokens(9000, 9000, PreprocessConfig())
    with pytest.raises(InferenceServerException) as e:
        _grpc_infer(grpc, PH * 3, image=[image] * 3)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == (f"k3_vision: INVALID_ARG: the images need {need} tokens, more than "
                                 f"max_image_tokens_per_request 32768")


# ---- HTTP/REST JSON: BF16 outputs come as binary data (KServe binary tensor extension) -------------


def _http_json_infer(triton, body: dict) -> tuple[int, dict, bytes]:
    """POST /v2/models/k3_vision/infer with a JSON body: (status, JSON header, binary tail)."""
    req = urllib.request.Request(f"{triton.http_url}/v2/models/k3_vision/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw, header_len = r.status, r.read(), r.headers.get("Inference-Header-Content-Length")
    except urllib.error.HTTPError as err:
        status, raw, header_len = err.code, err.read(), None
    n = int(header_len) if header_len is not None else len(raw)
    return status, json.loads(raw[:n]), raw[n:]


def test_e2e_http_json_infer_with_binary_image_embeds(grpc, triton, server: VisionServer) -> None:  # [TOP-5]
    image = b64(60, 40, 11).decode()
    inputs = [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [PH]},
              {"name": "image", "shape": [1, 1], "datatype": "BYTES", "data": [image]}]
    # Plain JSON cannot carry BF16 (Triton's rule): the request names the output it cannot send.
    status, header, _ = _http_json_infer(triton, {"inputs": inputs})
    assert status == 400 and "BF16" in header["error"], header
    # The documented way: image_embeds as binary data, the small outputs as JSON.
    outputs = [{"name": "image_embeds", "parameters": {"binary_data": True}}] + [{"name": n} for n in OUTPUTS[1:]]
    status, header, tail = _http_json_infer(triton, {"inputs": inputs, "outputs": outputs})
    assert status == 200, header
    got = {o["name"]: o for o in header["outputs"]}
    embeds = got["image_embeds"]
    assert embeds["datatype"] == "BF16" and embeds["parameters"]["binary_data_size"] == len(tail)
    rows = np.frombuffer(tail, dtype="<u2").reshape(embeds["shape"])  # BF16 bit patterns
    want = _as_outputs(_grpc_infer(grpc, PH, image=[image.encode()]))
    n = image_num_tokens(60, 40, PreprocessConfig())
    assert rows.shape == want["image_embeds"].shape == (1, n, server.model.cfg.text_hidden_size)
    assert np.array_equal(rows, _bits(want["image_embeds"]))  # the same rows as over gRPC, bit for bit
    assert got["image_token_counts"]["data"] == want["image_token_counts"].reshape(-1).tolist() == [n]
    assert got["image_grid_thw"]["data"] == want["image_grid_thw"].reshape(-1).tolist()
    assert got["image_sizes"]["data"] == [60, 40]
    assert got["image_hashes"]["data"] == [h.decode() for h in want["image_hashes"].reshape(-1)]
    # A BF16 value is the top half of a float32: the rows as numbers match the in-process model's.
    as_f32 = (rows.astype(np.uint32) << 16).view(np.float32)
    (ref,) = server.execute([VisionRequest(text_input=PH.encode(), image=[image.encode()])])
    torch.testing.assert_close(torch.from_numpy(as_f32), ref["image_embeds"].float(), rtol=1e-2, atol=1e-2)


def test_e2e_tritonclient_http_with_binary_outputs(http, grpc) -> None:
    import tritonclient.http as httpclient

    image = [b64(45, 45, 12)]
    requested = [httpclient.InferRequestedOutput(n, binary_data=True) for n in OUTPUTS]
    result = http.infer("k3_vision", _inputs(httpclient, PH, image=image), outputs=requested)
    got, want = _as_outputs(result), _as_outputs(_grpc_infer(grpc, PH, image=image))
    check_outputs(got, [(45, 45)])
    assert np.array_equal(_bits(got["image_embeds"]), _bits(want["image_embeds"]))
