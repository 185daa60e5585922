"""One Triton request's tensors and parameters -> `ParsedRequest` (SERVING.md §2.2, §4.2, §5.1-5.3, §6.3).

Pure Python so it is unit-testable without Triton: inputs arrive through `get(name)`, which returns
the tensor exactly as Triton delivers it (leading batch dimension of 1 included, or None when the
input is absent), plus the request parameters (already JSON-decoded) and the request id.

Everything here is cheap: no tokenization. `serving.prompt.build_request` does the rest (placeholder
counts, prompt length, SMP-5). Every client mistake raises `InvalidArgument` or `Unsupported` with a
message that names the input and the value (ERR-1, ERR-3).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3backend.engine.sampling_params import SamplingParams
from k3backend.errors import InvalidArgument, Unsupported
from k3backend.serving.inputs import (
    BOOL,
    FP32,
    INT32,
    UINT64,
    Inputs,
    TensorGetter,
    alias,
    as_int32s,
    as_stop,
    as_strs,
    decode_utf8,
)
from k3backend.serving.prompt import (
    ImageInputs,
    parse_images,
    parse_json,
    parse_messages,
    parse_thinking,
)

MAX_SAMPLING_PARAMETERS_BYTES = 64 * 1024
MAX_STOP_WORDS, MAX_STOP_TOKEN_IDS, MAX_BAD_WORDS, MAX_WORD_BYTES = 32, 64, 256, 256
MAX_TOP_LOGPROBS = 20
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
IMAGE_INPUTS = ("image_embeds", "image_token_counts", "image_grid_thw", "image_sizes", "image_hashes")

# [SMP-3] accepted `sampling_parameters` keys and the coercion of each: a scalar takes the §2.2
# type of its tensor (`logprobs` that of top_logprobs, `n`/`best_of` that of num_return_sequences),
# so a JSON value is refused exactly when the tensor could not carry it (top_k 1e20, 2.5, true).
SAMPLING_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "max_tokens": INT32, "min_tokens": INT32, "temperature": FP32, "top_p": FP32, "top_k": INT32,
    "min_p": FP32, "presence_penalty": FP32, "frequency_penalty": FP32,
    "repetition_penalty": FP32, "seed": UINT64, "stop": as_stop, "stop_token_ids": as_int32s,
    "bad_words": as_strs, "ignore_eos": BOOL, "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL, "spaces_between_special_tokens": BOOL, "logprobs": INT32,
    "n": INT32, "best_of": INT32, "detokenize": BOOL,
}
UNSUPPORTED_SAMPLING_KEYS = ("prompt_logprobs", "logit_bias", "allowed_token_ids", "structured_outputs",
                             "guided_decoding", "lora_name", "truncate_prompt_tokens")


@dataclass(frozen=True)
class LmDefaults:
    """The k3_lm model parameters (§4.4) and checkpoint facts that request parsing depends on.

    The five generation-config fields are level 4 of [SMP-1]; None means the §2.2 default.
    """

    vocab_size: int
    hidden_size: int  # text hidden size: the width `image_embeds` must have (§4.2)
    default_max_tokens: int = 16
    exclude_input_in_output: bool = True
    default_thinking: bool = False
    max_prompt_bytes: int = 8388608
    allow_stop_by_request_id: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    has_vision: bool = True  # False: a text-only checkpoint, image inputs are refused
    model_type: str = "kimi_k3"


@dataclass(frozen=True)
class OutputOptions:
    """Which outputs the request asked for (§2.3, [OUT-1]) and how to send them (§5.7)."""

    stream: bool = False
    exclude_input_in_output: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_log_probs: bool = False  # TRT-LLM cum_log_probs + output_log_probs
    return_cumulative_logprob: bool = False  # vLLM cumulative_logprob
    return_logprobs: bool = False  # vLLM logprobs JSON
    top_logprobs: int = 0
    return_reasoning: bool = False
    return_perf_metrics: bool = False

    @property
    def needs_logprobs(self) -> bool:
        """[LP-4]: log-probabilities are computed only when some output carries them."""
        return self.return_log_probs or self.return_cumulative_logprob or self.return_logprobs


@dataclass(frozen=True)
class ParsedRequest:
    """A validated k3_lm request, not yet tokenized.

    Exactly one of `text_input` / `messages` is set for a generation request; neither for a stop
    request (`is_stop`, §6.3). `sampling.max_tokens` is provisional: `max_tokens` is the explicit
    value (None when no source gave one) and `build_request` resolves the effective one ([SMP-5]).
    `sampling.logprobs` is None unless an output needs log-probabilities ([LP-4]).
    """

    request_id: str
    is_stop: bool = False
    text_input: str | None = None
    messages: list[dict[str, Any]] | None = None
    thinking: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    outputs: OutputOptions = field(default_factory=OutputOptions)
    images: ImageInputs | None = None
    arrival_time: float = field(default_factory=time.time)  # wall clock at parse, s since the epoch


def generation_eos_ids(checkpoint_dir: str | Path) -> tuple[int, ...]:
    """EOS ids of `generation_config.json`, joined to the checkpoint's own ([STP-2])."""
    path = Path(checkpoint_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))


def load_generation_defaults(checkpoint_dir: str | Path) -> dict[str, float | int]:
    """The [SMP-1] level-4 defaults from `generation_config.json` (only the five keys vLLM takes).

    Returns {} without the file. Bad values fail the load naming the file ([CFG-L3]). The caller
    logs the result once ([CFG-L4]).
    """
    path = Path(checkpoint_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    values = {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}
    for key, value in values.items():
        if isinstance(value, str):  # a file, unlike a request ([SMP-3]), has no reason to quote numbers
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
    try:  # the request rules: the §2.2 type (top_k 40.5 is no integer), then the ranges
        out = {key: SAMPLING_KEYS[key](value, key) for key, value in values.items()}
        SamplingParams(**out)
    except InvalidArgument as e:
        raise ValueError(f"{path}: {e}") from e
    return out


def _sampling_json(text: str | None) -> dict[str, Any]:
    """[SMP-3] `sampling_parameters` -> {key: coerced value}; null values count as absent."""
    if text is None:
        return {}
    size = len(text.encode())
    if size > MAX_SAMPLING_PARAMETERS_BYTES:
        raise InvalidArgument(f"sampling_parameters is {size} bytes; at most {MAX_SAMPLING_PARAMETERS_BYTES} allowed")
    obj = parse_json("sampling_parameters", text)
    if not isinstance(obj, dict):
        raise InvalidArgument(f"sampling_parameters must be a JSON object, got {type(obj).__name__}")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key in UNSUPPORTED_SAMPLING_KEYS:
            if value is not None:
                raise Unsupported(f"{key} in sampling_parameters is not supported")
        elif key not in SAMPLING_KEYS:
            raise InvalidArgument(f"unknown key {key!r} in sampling_parameters")
        elif value is not None:
            out[key] = SAMPLING_KEYS[key](value, f"sampling_parameters.{key}")
    return out


def _request_params(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """[SMP-1] level 3: request parameters named like accepted keys; others are ignored ([SMP-4])."""
    return {key: SAMPLING_KEYS[key](value, f"request parameter {key!r}")
            for key, value in parameters.items() if key in SAMPLING_KEYS and value is not None}


# ---- sampling and output options ([SMP-1]..[SMP-3]) ----------------------------------------------


def _check_unsupported(inputs: Inputs) -> None:
    for name in ("beam_width", "num_return_sequences"):
        value = inputs.int(name)
        if value is not None and value > 1:
            raise Unsupported(f"{name} > 1 is not supported")
        if value is not None and value < 1:
            raise InvalidArgument(f"{name} must be 1, got {value}")
    for name in ("return_context_logits", "return_generation_logits"):
        if inputs.flag(name):
            raise Unsupported(f"{name} is not supported")
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        if inputs.raw(name):
            raise Unsupported(f"guided decoding is not supported ({name} is set)")


def _check_compat_keys(levels: tuple[dict[str, Any], ...]) -> None:
    """[SMP-3] n / best_of: 1 or null; detokenize: only true. The first level that has it decides."""
    for key, ok in (("n", (1,)), ("best_of", (1,)), ("detokenize", (True,))):
        value = next((level[key] for level in levels if key in level), None)
        if value is not None and value not in ok:
            raise Unsupported(f"{key} = {json.dumps(value)} is not supported")


def _check_words(words: list[str], where: str, limit: int) -> tuple[str, ...]:
    if len(words) > limit:
        raise InvalidArgument(f"{where}: at most {limit} strings allowed, got {len(words)}")
    for i, word in enumerate(words):
        size = len(word.encode("utf-8", errors="surrogatepass"))
        if not 1 <= size <= MAX_WORD_BYTES:
            raise InvalidArgument(f"{where}[{i}] must be 1 to {MAX_WORD_BYTES} bytes, got {size}")
    return tuple(words)


def _check_id(value: int, where: str, vocab_size: int) -> int:
    if not 0 <= value < vocab_size:
        raise InvalidArgument(f"{where} must be in [0, {vocab_size}), got {value}")
    return value


def _resolve_sampling(inputs: Inputs, js: dict[str, Any], ps: dict[str, Any],
                      defaults: LmDefaults, outputs: OutputOptions) -> tuple[SamplingParams, int | None]:
    """[SMP-1]: tensor > sampling_parameters > request parameter > generation_config > §2.2 default."""

    def pick(key: str, tensor: Any, fallback: Any = None, tensor_name: str = "") -> tuple[Any, str]:
        if tensor is not None:
            return tensor, tensor_name or key
        for level, where in ((js, f"sampling_parameters.{key}"), (ps, f"request parameter {key!r}")):
            if key in level:
                return level[key], where
        return fallback, key

    def value(key: str, tensor: Any, fallback: Any = None) -> Any:
        return pick(key, tensor, fallback)[0]

    max_tokens = value("max_tokens", inputs.int("max_tokens"))
    seed = value("seed", alias(inputs, "seed", "random_seed", UINT64))
    top_k = value("top_k", inputs.int("top_k"), _or(defaults.top_k, 0))
    stop, stop_where = pick("stop", inputs.texts("stop_words"), [], "stop_words")
    bad, bad_where = pick("bad_words", inputs.texts("bad_words"), [])
    stop_ids, ids_where = pick("stop_token_ids", inputs.ints("stop_token_ids"), [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"{ids_where}: at most {MAX_STOP_TOKEN_IDS} ids allowed, got {len(stop_ids)}")
    end_id, pad_id = inputs.int("end_id"), inputs.int("pad_id")
    for name, tid in (("end_id", end_id), ("pad_id", pad_id)):
        if tid is not None:
            _check_id(tid, name, defaults.vocab_size)
    length_penalty = inputs.float("length_penalty")
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise InvalidArgument(f"length_penalty must be finite, got {length_penalty}")
    params = SamplingParams(
        max_tokens=defaults.default_max_tokens if max_tokens is None else max_tokens,
        min_tokens=value("min_tokens", alias(inputs, "min_tokens", "min_length"), 0),
        temperature=value("temperature", inputs.float("temperature"), _or(defaults.temperature, 1.0)),
        top_k=0 if top_k == -1 or top_k > defaults.vocab_size else top_k,  # both mean off (§2.2)
        top_p=value("top_p", inputs.float("top_p"), _or(defaults.top_p, 1.0)),
        min_p=value("min_p", inputs.float("min_p"), _or(defaults.min_p, 0.0)),
        repetition_penalty=value("repetition_penalty", inputs.float("repetition_penalty"),
                                 _or(defaults.repetition_penalty, 1.0)),
        presence_penalty=value("presence_penalty", inputs.float("presence_penalty"), 0.0),
        frequency_penalty=value("frequency_penalty", inputs.float("frequency_penalty"), 0.0),
        seed=seed,
        ignore_eos=value("ignore_eos", inputs.flag("ignore_eos"), False),
        end_id=end_id,
        stop=_check_words(stop, stop_where, MAX_STOP_WORDS),
        stop_token_ids=tuple(_check_id(t, f"{ids_where}[{i}]", defaults.vocab_size) for i, t in enumerate(stop_ids)),
        bad_words=_check_words(bad, bad_where, MAX_BAD_WORDS),
        include_stop_str_in_output=value("include_stop_str_in_output", None, False),
        skip_special_tokens=value("skip_special_tokens", None, True),
        logprobs=(outputs.top_logprobs if outputs.return_logprobs else 0) if outputs.needs_logprobs else None,
    )
    return params, max_tokens


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _output_options(inputs: Inputs, js: dict[str, Any], ps: dict[str, Any], defaults: LmDefaults) -> OutputOptions:
    flags = {name: bool(inputs.flag(name)) for name in (
        "stream", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
        "return_log_probs", "return_cumulative_logprob", "return_logprobs", "return_reasoning",
        "return_perf_metrics")}
    exclude = inputs.flag("exclude_input_in_output")
    top, where = inputs.int("top_logprobs"), "top_logprobs"
    if top is None:
        top, where = next(((level["logprobs"], w) for level, w in ((js, "sampling_parameters.logprobs"),
                           (ps, "request parameter 'logprobs'")) if "logprobs" in level), (0, where))
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"{where} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return OutputOptions(exclude_input_in_output=defaults.exclude_input_in_output if exclude is None else exclude,
                         top_logprobs=top, **flags)


def _images(inputs: Inputs, hidden_size: int) -> ImageInputs | None:
    """The five internal image tensors (§2.4): all present or all absent (text-only), then [VIS-2]."""
    arrays = {name: inputs.array(name) for name in IMAGE_INPUTS}
    present = [name for name, arr in arrays.items() if arr is not None]
    if not present:
        return None
    if len(present) != len(IMAGE_INPUTS):
        missing = [name for name in IMAGE_INPUTS if name not in present]
        raise InvalidArgument(f"image inputs come together: got {', '.join(present)} but not {', '.join(missing)}")
    hashes = inputs.texts("image_hashes") or []
    return parse_images(arrays["image_embeds"], arrays["image_token_counts"], arrays["image_grid_thw"],
                        arrays["image_sizes"], hashes, hidden_size)


def _prompt_source(inputs: Inputs, defaults: LmDefaults) -> tuple[str, list[dict[str, Any]] | None, int, bool]:
    """[PRM-1]..[PRM-3]: (text_input, messages, image parts in messages, thinking)."""
    raw = {name: inputs.raw(name) for name in ("text_input", "messages")}
    for name, value in raw.items():
        if value is not None and len(value) > defaults.max_prompt_bytes:
            raise InvalidArgument(f"{name} is {len(value)} bytes; max_prompt_bytes is {defaults.max_prompt_bytes}")
    text = decode_utf8(raw["text_input"] or b"", "text_input")  # absent only in tests: Triton requires it
    messages_text = None if raw["messages"] is None else decode_utf8(raw["messages"], "messages")
    kwargs_text = inputs.text("chat_template_kwargs")
    if messages_text is not None and text:
        raise InvalidArgument('send the prompt either in text_input or in messages (with text_input ""), not both')
    if messages_text is None and not text:
        raise InvalidArgument('empty prompt: text_input is "" and messages is absent')
    if kwargs_text is not None and messages_text is None:
        raise InvalidArgument("chat_template_kwargs is only allowed with messages")
    messages, n_image_parts = (None, 0) if messages_text is None else parse_messages(messages_text)
    return text, messages, n_image_parts, parse_thinking(kwargs_text, defaults.default_thinking)


# ---- the entry point -----------------------------------------------------------------------------


def is_stop(get: TensorGetter) -> bool:
    """[CAN-3]: a stop request is any request with stop=true (a malformed flag raises)."""
    return bool(Inputs(get).flag("stop"))


def parse_request(get: TensorGetter, parameters: Mapping[str, Any], request_id: str,
                  defaults: LmDefaults) -> ParsedRequest:
    """Validate one k3_lm request (every §2.2 / §4.2 / §5.1-5.3 rule that needs no tokenizer)."""
    inputs = Inputs(get)
    if is_stop(get):  # [CAN-4]: every other input is ignored
        if not defaults.allow_stop_by_request_id:
            raise Unsupported("stop requests are disabled (allow_stop_by_request_id=false)")
        if not request_id:
            raise InvalidArgument("a stop request needs a request id")
        return ParsedRequest(request_id=request_id, is_stop=True)

    text, messages, n_image_parts, thinking = _prompt_source(inputs, defaults)
    _check_unsupported(inputs)
    js = _sampling_json(inputs.text("sampling_parameters"))
    ps = _request_params(parameters)
    _check_compat_keys((js, ps))
    outputs = _output_options(inputs, js, ps, defaults)
    sampling, max_tokens = _resolve_sampling(inputs, js, ps, defaults, outputs)
    images = _images(inputs, defaults.hidden_size)
    if images is not None and not defaults.has_vision:
        raise InvalidArgument(f"this checkpoint has no vision tower (model_type {defaults.model_type}): "
                              "it serves text only")
    if n_image_parts and images is None:
        raise InvalidArgument("images need k3_ensemble or precomputed image_embeds")
    return ParsedRequest(request_id=request_id, text_input=None if messages is not None else text,
                         messages=messages, thinking=thinking, sampling=sampling, max_tokens=max_tokens,
                         outputs=outputs, images=images)
