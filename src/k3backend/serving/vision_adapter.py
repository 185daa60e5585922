"""The logic behind `k3_vision` (SERVING.md §3): parameters, the tower, per-request results.

`VisionServer` is plain Python (no Triton): `execute(requests)` returns, per request, either a
dict of output arrays (empty for a text-only request [VIS-1], all five outputs otherwise
[VIS-2]) or the `K3Error` that request fails with. One request's error never touches another's
result [VIS-7]. The `triton_*` functions at the end are the only code that sees `pb_utils`
(passed in, so this module imports without Triton); `model_repository/k3_vision/1/model.py`
just calls them.

Batch invariance [VIS-8]: every image runs through tower and projector on its own. Packing
images into one forward changes the GEMM shapes, and with them the kernels: measured on an H200
(bf16 and fp32) packed results differ in the last bits from single-image ones, and on CPU the
projector does too for images of fewer than 4 tokens. Per-image runs cost about 20% throughput
against packing at K3 size on an H200 (7 images, 17k patches); results are then bit-identical
whatever the batch.

Memory: images are decoded one at a time and each decoded frame is dropped once it is
preprocessed; the tower's attention memory is linear in the patches (`image_attention`). After a
batch whose images made large transient allocations the freed heap goes back to the OS
(`release_free_heap`), so the process's RSS does not ratchet up to the largest request seen.

A stop request (`stop` = true) is answered at once with no outputs: its other inputs are ignored
[CAN-3], so they are neither read nor validated; k3_lm, the next step, does the stopping.

A checkpoint without a vision tower (a text-only `kimi_linear` one, or `kimi_k3` without a
`vision_config`) loads with no model: text-only requests pass through as always, so `k3_ensemble`
serves it, and a request with images or image placeholders fails with INVALID_ARG.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3backend.config import ConfigError
from k3backend.errors import InvalidArgument, K3Error, Unavailable
from k3backend.model.preprocess import (
    PreprocessConfig,
    ProcessedImage,
    image_num_tokens,
    preprocess_image,
)
from k3backend.model.vision import ROPE_MAX_SIDE
from k3backend.serving.heap import release_free_heap
from k3backend.serving.images import (
    ImageLimits,
    ImageReader,
    UrlFetcher,
    UrlPolicy,
    check_placeholder_count,
    collect_sources,
    count_placeholders,
    image_hash,
    load_pixels,
    message_image_parts,
    preprocess_digest,
)
from k3backend.serving import lifecycle
from k3backend.serving.inputs import decode_utf8
from k3backend.serving.metrics import (
    ERROR_CODES,
    VISION_ENCODE_BUCKETS,
    NullMetrics,
    TritonMetrics,
)
from k3backend.serving.prompt import parse_messages
from k3backend.serving.triton_io import (
    ModelParams,
    data_response,
    error_response,
    request_id,
    resolve_device_dtype,
    setup_logging,
)
from k3backend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MODEL = "k3_vision"
OUTPUTS = ("image_embeds", "image_token_counts", "image_grid_thw", "image_sizes", "image_hashes")
# SERVING.md §3.4 with their defaults; "" for in_patch_limit / patch_limit_on_one_side = the checkpoint's.
PARAMETERS = {
    "model_path": "", "device": "auto", "gpu_device_ids": "0", "dtype": "auto",
    "max_images_per_request": "16", "max_image_bytes": "33554432", "max_total_image_bytes": "134217728",
    "max_image_pixels": "89478485", "max_image_tokens_per_request": "32768",
    "in_patch_limit": "", "patch_limit_on_one_side": "",
    "allow_remote_image_urls": "false", "remote_image_url_allowlist": "", "allow_private_network_urls": "false",
    "url_fetch_timeout_s": "10", "REPORT_CUSTOM_METRICS": "true", "metrics_prefix": "k3",
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EMBED_DTYPES = {"TYPE_BF16": torch.bfloat16, "TYPE_FP32": torch.float32}
_WARMUP_SIZE = (56, 42)  # W, H of the warm-up image [HLT-3]
# A batch whose images held more than this on the host (decoded frames, patches) is followed by a
# heap trim; below it, what glibc keeps is small and is reused by the next request.
TRIM_AFTER_BYTES = 32 << 20


@dataclass(frozen=True)
class VisionParams:
    """Parsed `parameters` of config.pbtxt; every value checked at load."""

    model_path: str
    device: str  # auto | cuda | cpu
    gpu_device_id: int
    dtype: str  # auto | bfloat16 | float16 | float32
    limits: ImageLimits
    max_image_tokens_per_request: int
    in_patch_limit: int | None
    patch_limit_on_one_side: int | None
    url_policy: UrlPolicy
    report_metrics: bool
    metrics_prefix: str

    @classmethod
    def from_model_config(cls, model_config: dict[str, Any]) -> VisionParams:
        p = ModelParams(model_config, PARAMETERS, MODEL)
        hosts = p.str("remote_image_url_allowlist").split(",")
        allowlist = tuple(h.strip().lower().rstrip(".") for h in hosts if h.strip())
        return cls(
            model_path=p.str("model_path"),
            device=p.choice("device", ("auto", "cuda", "cpu")),
            gpu_device_id=p.int("gpu_device_ids", lo=0),
            dtype=p.choice("dtype", ("auto", *DTYPES)),
            limits=ImageLimits(
                max_images_per_request=p.int("max_images_per_request", lo=1),
                max_image_bytes=p.int("max_image_bytes", lo=1),
                max_total_image_bytes=p.int("max_total_image_bytes", lo=1),
                max_image_pixels=p.int("max_image_pixels", lo=1),
            ),
            max_image_tokens_per_request=p.int("max_image_tokens_per_request", lo=1),
            in_patch_limit=p.int("in_patch_limit", lo=4, optional=True),
            patch_limit_on_one_side=p.int("patch_limit_on_one_side", lo=2, hi=ROPE_MAX_SIDE, optional=True),
            url_policy=UrlPolicy(
                allow_remote=p.bool("allow_remote_image_urls"),
                allowlist=allowlist,
                allow_private=p.bool("allow_private_network_urls"),
                timeout_s=p.float("url_fetch_timeout_s", lo=0.001),
            ),
            report_metrics=p.bool("REPORT_CUSTOM_METRICS"),
            metrics_prefix=p.str("metrics_prefix") or "k3",
        )


@dataclass(frozen=True)
class VisionRequest:
    """One Triton request's inputs, batch dimension removed. BYTES elements stay bytes."""

    text_input: bytes | None = None
    messages: bytes | None = None
    image_url_input: list[bytes] | None = None
    image: list[bytes] | None = None
    image_bytes_input: np.ndarray | None = None  # [N, H, W, C] uint8
    request_id: str = ""
    batch_size: int = 1
    stop: bool = False  # a stop request: answered with no outputs, nothing else read [CAN-3]


VisionResult = dict[str, Any] | K3Error


class VisionServer:
    """Tower + projector of one model instance and the per-request logic of SERVING.md §3.5."""

    def __init__(self, params: VisionParams, model: torch.nn.Module | None, preprocess_cfg: PreprocessConfig,
                 tokenizer: Tokenizer, embeds_dtype: torch.dtype, metrics: NullMetrics | None = None,
                 no_tower: str = "") -> None:
        """model None: the checkpoint has no tower; `no_tower` then says which checkpoint (error messages)."""
        self.params = params
        self.model = model
        self.no_tower = no_tower
        self.preprocess_cfg = preprocess_cfg
        self.tokenizer = tokenizer
        self.embeds_dtype = embeds_dtype
        self.metrics = metrics or NullMetrics()
        self.device = next(model.parameters()).device if model is not None else torch.device("cpu")
        self.reader = ImageReader(params.limits, UrlFetcher(params.url_policy))
        self._config_digest = preprocess_digest(preprocess_cfg)

    @classmethod
    def from_model_config(cls, model_config: dict[str, Any], model_instance_device_id: int = 0,
                          metrics: NullMetrics | None = None) -> VisionServer:
        """Parse the parameters, load tower, projector, preprocessing config and tokenizer.

        `model_instance_device_id` is Triton's; with KIND_MODEL the GPU is `gpu_device_ids`.
        """
        from k3backend.checkpoint import load_vision
        from k3backend.config import K3Config
        from k3backend.presets import ensure_default_checkpoint

        params = VisionParams.from_model_config(model_config)
        embeds_dtype = _declared_embeds_dtype(model_config)
        device, dtype = _device_and_dtype(params, _instance_count(model_config))
        path = Path(params.model_path) if params.model_path else ensure_default_checkpoint()
        cfg = K3Config.from_json(path)
        model, preprocess_cfg, no_tower = None, PreprocessConfig(), ""
        if cfg.vision is not None:
            model, preprocess_cfg = load_vision(path, dtype=dtype, device=device, progress=False)
        else:
            no_tower = f"model_type {cfg.model_type}" + (", no vision_config" if cfg.model_type == "kimi_k3" else "")
        overrides = {k: v for k, v in (("in_patch_limit", params.in_patch_limit),
                                       ("patch_limit_on_one_side", params.patch_limit_on_one_side)) if v is not None}
        preprocess_cfg = dataclasses.replace(preprocess_cfg, **overrides)
        if not (path / "tiktoken.model").is_file():
            raise ConfigError(f"{MODEL}: {path} has no tokenizer (tiktoken.model); it is needed to count "
                              f"image placeholders [VIS-6]")
        tokenizer = Tokenizer.from_dir(path)
        if model is None:
            logger.info("%s: loaded without a vision tower (checkpoint %s, %s): text-only requests pass "
                        "through, image inputs fail with INVALID_ARG", MODEL, path, no_tower)
        else:
            logger.info("%s: tower on %s (%s), embeddings %s, checkpoint %s, instance device id %s",
                        MODEL, device, dtype, embeds_dtype, path, model_instance_device_id)
        return cls(params, model, preprocess_cfg, tokenizer, embeds_dtype, metrics, no_tower)

    def warm_up(self) -> None:
        """One image through preprocessing, tower and projector [HLT-3]; not counted in metrics."""
        from PIL import Image

        if self.model is None:
            return
        image = Image.new("RGB", _WARMUP_SIZE, (128, 64, 32))
        (embeds,) = self._encode([preprocess_image(image, self.preprocess_cfg)])
        logger.info("%s: warm-up image %dx%d -> %s embeddings", MODEL, *_WARMUP_SIZE, list(embeds.shape))

    def close(self) -> None:
        self.metrics.close()

    # ---- per batch ------------------------------------------------------------------------------

    def execute(self, requests: Sequence[VisionRequest]) -> list[VisionResult]:
        """One result per request, in order. Never raises: a defect is that request's INTERNAL."""
        start = time.perf_counter()
        results: list[VisionResult] = []
        for request in requests:
            try:
                results.append(self._prepare(request))
            except K3Error as e:
                results.append(e)
            except Exception:
                results.append(internal_error(request.request_id))
        if self._encode_prepared(results, requests) >= TRIM_AFTER_BYTES:
            release_free_heap()
        if self.device.type == "cuda":  # DLPack hands the outputs over without waiting for kernels
            torch.cuda.synchronize(self.device)
        for result in results:
            if isinstance(result, K3Error):
                self.metrics.inc("request_failure_total", code=result.code)
            elif result:
                self.metrics.inc("vision_images_total", len(result["image_token_counts"][0]))
                self.metrics.observe("vision_encode_seconds", time.perf_counter() - start)
        return results

    def _encode_prepared(self, results: list[Any], requests: Sequence[VisionRequest]) -> int:
        """Replace each request's prepared images by its outputs, in place (each request's images
        are freed as soon as they are encoded). Returns the host bytes those images held."""
        held = 0
        for i, result in enumerate(results):
            if isinstance(result, list):
                held += sum(_host_bytes(p) for p in result)
                # text-only and stop requests have no images: no outputs [VIS-1]
                results[i] = self._outputs_or_error(result, requests[i].request_id) if result else {}
        return held

    def _prepare(self, request: VisionRequest) -> list[ProcessedImage]:
        """Validation, decoding and preprocessing of one request: [] when it has no images."""
        if request.stop:  # nothing else is looked at [CAN-3]
            return []
        if request.batch_size != 1:
            raise InvalidArgument(f"one prompt per request: expected batch size 1, got {request.batch_size}")
        text = decode_utf8(request.text_input or b"", "text_input")
        parts = None
        if request.messages is not None:
            parts = message_image_parts(parse_messages(decode_utf8(request.messages, "messages"))[0])
        sources = collect_sources(request.image_url_input, request.image, request.image_bytes_input, parts)
        placeholders = count_placeholders(text, parts, self.tokenizer)
        if not sources and not placeholders:
            return []
        if self.model is None:
            raise InvalidArgument(f"this checkpoint has no vision tower ({self.no_tower}): it serves text only")
        check_placeholder_count(placeholders, len(sources))  # before any image is read [VIS-6]
        images = self.reader.open_all(sources)
        tokens = 0
        for i, image in enumerate(images):
            try:
                tokens += image_num_tokens(*image.size, self.preprocess_cfg)
            except ValueError as e:
                raise InvalidArgument(f"image {i}: {e}") from None
        limit = self.params.max_image_tokens_per_request
        if tokens > limit:  # before the tower runs
            raise InvalidArgument(f"the images need {tokens} tokens, more than max_image_tokens_per_request {limit}")
        processed = []
        for i in range(len(images)):  # one decoded frame at a time: each is dropped once preprocessed
            image, images[i] = load_pixels(images[i], i), None
            try:
                processed.append(preprocess_image(image, self.preprocess_cfg))
            except (ValueError, OSError) as e:  # e.g. a pixel mode Pillow cannot convert to RGB
                raise InvalidArgument(f"image {i}: cannot preprocess {image.mode} image: {e}") from None
            finally:
                image.close()
        return processed

    def _outputs_or_error(self, processed: list[ProcessedImage], request_id: str) -> VisionResult:
        try:
            embeds = torch.cat(self._encode(processed))  # [ΣN, E]
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            logger.warning("%s: out of GPU memory encoding %d images (request %r)", MODEL, len(processed), request_id)
            return Unavailable("out of GPU memory while encoding the images; retry, or send fewer or smaller images")
        except Exception:
            return internal_error(request_id)
        counts = [p.num_tokens for p in processed]
        assert embeds.shape[0] == sum(counts), (embeds.shape, counts)
        return {
            "image_embeds": embeds.unsqueeze(0).contiguous(),  # [1, ΣN, E]
            "image_token_counts": np.array([counts], dtype=np.int32),
            "image_grid_thw": np.array([[p.grid_thw for p in processed]], dtype=np.int64),
            "image_sizes": np.array([[p.size for p in processed]], dtype=np.int32),
            "image_hashes": np.array([[image_hash(self._config_digest, p).encode() for p in processed]], dtype=object),
        }

    @torch.inference_mode()
    def _encode(self, processed: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        """[N_i, E] per image in the declared dtype; one forward per image [VIS-8]."""
        return [self.model(p.pixel_values.to(self.device), [p.grid_thw]).to(self.embeds_dtype) for p in processed]


def _host_bytes(image: ProcessedImage) -> int:
    """Host memory one image went through: its decoded frame (Pillow keeps RGB as 4 bytes a pixel),
    its resized uint8 copy and its float32 patches."""
    w0, h0 = image.size
    return 4 * w0 * h0 + image.resized_uint8.nbytes + image.pixel_values.nbytes


def internal_error(request_id: str) -> K3Error:
    """Log the active exception once with its traceback, and return the client's INTERNAL [ERR-3]."""
    logger.error("%s: unexpected error in request %r:\n%s", MODEL, request_id, traceback.format_exc())
    return K3Error(f"unexpected error (see server log, request id '{request_id}')")


def _declared_embeds_dtype(model_config: dict[str, Any]) -> torch.dtype:
    """The dtype config.pbtxt declares for image_embeds [ENS-3]."""
    for out in model_config.get("output", []):
        if out.get("name") == "image_embeds":
            declared = out.get("data_type")
            if declared not in EMBED_DTYPES:
                raise ConfigError(f"{MODEL}: output image_embeds: data_type must be one of "
                                  f"{sorted(EMBED_DTYPES)}, got {declared!r}")
            return EMBED_DTYPES[declared]
    raise ConfigError(f"{MODEL}: config.pbtxt declares no output image_embeds")


def _instance_count(model_config: dict[str, Any]) -> int:
    return sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1


def _device_and_dtype(params: VisionParams, instances: int) -> tuple[torch.device, torch.dtype]:
    device, dtype = resolve_device_dtype(params.device, params.dtype, MODEL, params.gpu_device_id)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the instances share the cores; each forward is sequential within an instance
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // instances))
    return device, dtype


# ---- Triton glue (pb_utils passed in) ------------------------------------------------------------


def triton_initialize(pb_utils: Any, args: dict[str, Any]) -> VisionServer:
    """`initialize`: parameters, metrics, model, warm-up. Raises on any problem (the load fails)."""
    import json

    setup_logging()
    lifecycle.watch_parent(MODEL)
    model_config = json.loads(args["model_config"])
    params = VisionParams.from_model_config(model_config)
    metrics: NullMetrics = NullMetrics()
    if params.report_metrics:
        metrics = TritonMetrics(pb_utils, params.metrics_prefix, model=args.get("model_name", MODEL),
                                version=args.get("model_version", "1"))
        metrics.counter("vision_images_total", "Images encoded by k3_vision")
        metrics.counter("request_failure_total", "Error final responses", labels={"code": ERROR_CODES})
        metrics.histogram("vision_encode_seconds", "Time k3_vision spends per request with images",
                          VISION_ENCODE_BUCKETS)
        metrics.start()
    try:
        server = VisionServer.from_model_config(model_config, int(args.get("model_instance_device_id") or 0), metrics)
        server.warm_up()
        logger.info("%s: instance %s ready", MODEL, args.get("model_instance_name", "?"))
    except BaseException:
        metrics.close()
        raise
    return server


def triton_execute(pb_utils: Any, server: VisionServer, requests: Sequence[Any]) -> list[Any]:
    """`execute`: one response per request; never raises [VIS-7]."""
    inputs: list[VisionRequest | K3Error] = []
    for request in requests:
        try:
            inputs.append(read_request(pb_utils, request))
        except K3Error as e:  # e.g. an id that is not UTF-8
            inputs.append(e)
            server.metrics.inc("request_failure_total", code=e.code)
        except Exception:
            inputs.append(internal_error(_request_id(request)))
            server.metrics.inc("request_failure_total", code="INTERNAL")
    valid = [r for r in inputs if isinstance(r, VisionRequest)]
    try:
        done = iter(server.execute(valid))
    except Exception:  # execute catches per request; this is a last line of defence
        err = internal_error("")
        for _ in valid:
            server.metrics.inc("request_failure_total", code="INTERNAL")
        done = iter([err] * len(valid))
    responses = []
    for item in inputs:
        result = next(done) if isinstance(item, VisionRequest) else item
        try:
            responses.append(build_response(pb_utils, result))
        except Exception:
            server.metrics.inc("request_failure_total", code="INTERNAL")
            responses.append(build_response(pb_utils, internal_error(_request_id(item))))
    return responses


def read_request(pb_utils: Any, request: Any) -> VisionRequest:
    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    stop = get("stop")
    if stop is not None and stop.size == 1 and bool(stop.reshape(-1)[0]):  # [CAN-3]: nothing else is read
        return VisionRequest(request_id=request_id(request), stop=True)
    arrays = {name: get(name) for name in ("text_input", "messages", "image_url_input", "image", "image_bytes_input")}
    present = [a for a in arrays.values() if a is not None]
    batch = int(present[0].shape[0]) if present else 0
    if batch != 1 or any(a.shape[0] != 1 for a in present):
        return VisionRequest(request_id=request_id(request), batch_size=batch)

    def first(a: np.ndarray | None) -> bytes | None:
        return None if a is None or a.size == 0 else a.reshape(-1)[0]

    def items(a: np.ndarray | None) -> list[bytes] | None:
        return None if a is None else list(a.reshape(-1))

    pixels = arrays["image_bytes_input"]
    return VisionRequest(
        text_input=first(arrays["text_input"]), messages=first(arrays["messages"]),
        image_url_input=items(arrays["image_url_input"]), image=items(arrays["image"]),
        image_bytes_input=None if pixels is None else pixels[0], request_id=request_id(request),
    )


def build_response(pb_utils: Any, result: VisionResult) -> Any:
    """Outputs (bf16 through DLPack, which also keeps them on the GPU [ENS-4]) or the request's error."""
    if isinstance(result, K3Error):  # `k3_vision: <CODE>: <detail>` (SERVING.md §7.1, §7.3)
        return error_response(pb_utils, result.code, f"{MODEL}: {result.code}: {result}")
    return data_response(pb_utils, {name: result[name] for name in OUTPUTS} if result else {})


def _request_id(request: Any) -> str:
    try:
        return request.request_id() if not isinstance(request, VisionRequest) else request.request_id
    except Exception:
        return ""

