"""OpenAI request bodies -> Triton requests for k3_ensemble (docs/openai.md, docs/client-api.md).

The gateway checks only the shape of the OpenAI body (known fields, JSON types, what it cannot
map); every value range is k3_lm's to check, so one place owns each rule and its message comes
back as a 400. Sampling goes as TRT-LLM-dialect tensors, whose names are OpenAI's where both
have the field; the two vLLM switches that have no tensor go in `sampling_parameters`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from k3backend.openai.errors import ApiError, bad_request

MAX_CHOICES = 128  # n x prompts per request: each one is a Triton request
_INT32 = (-(2**31), 2**31 - 1)

# field -> (k3 input, Triton dtype). Ranges: docs/client-api.md "Inputs".
SAMPLING = {
    "temperature": ("temperature", "FP32"),
    "top_p": ("top_p", "FP32"),
    "top_k": ("top_k", "INT32"),
    "min_p": ("min_p", "FP32"),
    "presence_penalty": ("presence_penalty", "FP32"),
    "frequency_penalty": ("frequency_penalty", "FP32"),
    "repetition_penalty": ("repetition_penalty", "FP32"),
    "min_tokens": ("min_tokens", "INT32"),
    "ignore_eos": ("ignore_eos", "BOOL"),
}
# vLLM request switches without a tensor: sent inside sampling_parameters.
VLLM_SWITCHES = ("include_stop_str_in_output", "skip_special_tokens")
# Accepted and ignored: they change nothing about the generated text.
IGNORED = {"user", "service_tier", "store", "metadata", "parallel_tool_calls", "safety_identifier",
           "prompt_cache_key"}
# Accepted only with the value that means "off" (or null); anything else is a clear 400.
OFF_VALUES: dict[str, tuple] = {
    "logit_bias": ({},), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    "function_call": ("none",), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
    "suffix": ("",), "best_of": (1,),
}
COMMON = {"model", "stream", "stream_options", "max_tokens", "n", "stop", "seed", "stop_token_ids",
          "return_perf_metrics", *SAMPLING, *VLLM_SWITCHES, *IGNORED}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "thinking",
                        "chat_template_kwargs", "logit_bias", "tools", "functions", "tool_choice",
                        "function_call", "response_format", "modalities", "audio", "prediction",
                        "web_search_options", "reasoning_effort", "verbosity"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "logit_bias", "suffix", "best_of"}


@dataclass(frozen=True)
class Job:
    """One Triton request: choice `index` of the response, for prompt `prompt_index`."""

    request_id: str
    inputs: dict[str, tuple[Any, str]]  # k3 input name -> (value or list of values, Triton dtype)
    index: int
    prompt_index: int
    text_only: bool  # no image parts: k3_vision has nothing to do (the gateway's --text-model)


@dataclass(frozen=True)
class Plan:
    """What one OpenAI request becomes: its Triton requests and how to answer."""

    kind: str  # "chat" | "completion"
    jobs: list[Job]
    stream: bool
    include_usage: bool  # streaming: a last chunk with usage
    continuous_usage: bool  # streaming (vLLM's continuous_usage_stats): usage so far in every chunk
    logprobs: bool
    top_logprobs: int
    perf_metrics: bool  # extension: k3_lm's *_time_ns outputs in each choice's last chunk


def chat_plan(body: dict, served_name: str) -> Plan:
    """POST /v1/chat/completions -> Plan: the K3 chat format is rendered by k3_lm from `messages`."""
    _check_fields(body, CHAT_FIELDS, served_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of messages", "messages")
    inputs = {"text_input": ("", "BYTES"), "messages": (json.dumps([_message(m) for m in messages]), "BYTES"),
              "return_reasoning": (True, "BOOL")}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    if _get(body, "thinking", bool) is not None:
        kwargs["thinking"] = body["thinking"]
    if kwargs:
        inputs["chat_template_kwargs"] = (json.dumps(kwargs), "BYTES")
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    logprobs = bool(_get(body, "logprobs", bool))
    top = _get(body, "top_logprobs", int)
    if top is not None and not logprobs and top > 0:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return _plan("chat", body, [inputs], max_tokens, logprobs, top or 0, all(map(_text_only, messages)))


def completion_plan(body: dict, served_name: str) -> Plan:
    """POST /v1/completions -> Plan: each prompt is sent verbatim as text_input."""
    _check_fields(body, COMPLETION_FIELDS, served_name)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise bad_request("prompt must be a string or a non-empty array of strings (token-id prompts are "
                          "not supported)", "prompt")
    echo = bool(_get(body, "echo", bool))
    top = _get(body, "logprobs", int)
    if echo and top is not None:
        raise bad_request("echo with logprobs needs prompt log-probabilities, which are not supported", "echo")
    base: dict[str, tuple[Any, str]] = {"exclude_input_in_output": (False, "BOOL")} if echo else {}
    per_prompt = [{"text_input": (p, "BYTES"), **base} for p in prompts]
    return _plan("completion", body, per_prompt, _get(body, "max_tokens", int), top is not None, top or 0, True)


def _plan(kind: str, body: dict, per_prompt: list[dict], max_tokens: int | None, logprobs: bool,
          top_logprobs: int, text_only: bool) -> Plan:
    stream = bool(_get(body, "stream", bool))
    options = _get(body, "stream_options", dict) or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad_request(f"unknown key {unknown[0]!r} in stream_options", "stream_options")
    include_usage = stream and options.get("include_usage") is True
    continuous_usage = stream and options.get("continuous_usage_stats") is True
    n = _get(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n or n * len(per_prompt) > MAX_CHOICES:
        raise bad_request(f"n must be at least 1 and n x prompts at most {MAX_CHOICES}, got n = {n} with "
                          f"{len(per_prompt)} prompt(s)", "n")
    common = _sampling(body, max_tokens)
    common.update({"stream": (stream, "BOOL"), "return_finish_reason": (True, "BOOL"),
                   "return_num_input_tokens": (True, "BOOL"), "return_num_output_tokens": (True, "BOOL")})
    perf_metrics = bool(_get(body, "return_perf_metrics", bool))
    if include_usage or continuous_usage or not stream or perf_metrics:  # usage.prompt_tokens_details.cached_tokens
        common["return_perf_metrics"] = (True, "BOOL")
    if logprobs:
        common["return_logprobs"] = (True, "BOOL")
        common["top_logprobs"] = (top_logprobs, "INT32")
    seed = _get(body, "seed", int)
    if seed is not None and not 0 <= seed < 2**64:
        raise bad_request(f"seed must be in [0, 2**64), got {seed}", "seed")
    jobs = []
    for p, prompt_inputs in enumerate(per_prompt):
        for j in range(n):
            inputs = {**prompt_inputs, **common}
            if seed is not None:  # choice j draws with seed + j, so n > 1 gives n different samples
                inputs["seed"] = ((seed + j) % 2**64, "UINT64")
            jobs.append(Job(f"oai-{uuid.uuid4().hex}", inputs, p * n + j, p, text_only))
    return Plan(kind, jobs, stream, include_usage, continuous_usage, logprobs, top_logprobs, perf_metrics)


def _sampling(body: dict, max_tokens: int | None) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    if max_tokens is not None:
        out["max_tokens"] = (_int32("max_tokens", max_tokens), "INT32")
    for field, (name, dtype) in SAMPLING.items():
        kind = {"FP32": float, "INT32": int, "BOOL": bool}[dtype]
        value = _get(body, field, kind)
        if value is not None:
            out[name] = (_int32(field, value) if kind is int else value, dtype)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("stop must be a string or an array of strings", "stop")
        if stops:
            out["stop_words"] = (stops, "BYTES")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
            raise bad_request("stop_token_ids must be an array of integers", "stop_token_ids")
        if ids:
            out["stop_token_ids"] = ([_int32("stop_token_ids", i) for i in ids], "INT32")
    switches = {k: _get(body, k, bool) for k in VLLM_SWITCHES}
    switches = {k: v for k, v in switches.items() if v is not None}
    if switches:
        out["sampling_parameters"] = (json.dumps(switches), "BYTES")
    return out


def _message(message: Any) -> Any:
    """One OpenAI message in k3's `messages` schema; what does not fit is left for k3_vision to refuse.

    Null fields (`refusal`, `audio` and the like in echoed assistant messages) are dropped,
    `developer` is the system role, and an image part's `detail` hint is dropped (K3 resizes by
    its own limits).
    """
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "developer":
        out["role"] = "system"
    if isinstance(out.get("content"), list):
        out["content"] = [_part(p) for p in out["content"]]
    return out


def _text_only(message: Any) -> bool:
    """A message whose content is a string (or absent) or a list of text parts; anything else,
    images and malformed messages alike, goes through the ensemble (k3_vision reads or refuses it)."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    return content is None or isinstance(content, str) or (
        isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content))


def _part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
        return {**part, "image_url": {k: v for k, v in part["image_url"].items() if k != "detail"}}
    return part


def _check_fields(body: dict, allowed: set[str], served_name: str) -> None:
    for key, value in body.items():
        if key not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key)
        if key in OFF_VALUES and value is not None and value not in OFF_VALUES[key]:
            raise bad_request(f"{key} is not supported (only null{''.join(f' or {json.dumps(v)}' for v in OFF_VALUES[key])})",
                              key)
    model = body.get("model", served_name)
    if model != served_name:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict, key: str, kind: type) -> Any:
    """body[key] if it has JSON type `kind` (an int counts as a float), None if absent or null."""
    value = body.get(key)
    if value is None:
        return None
    ok = {bool: isinstance(value, bool), int: _is_int(value), dict: isinstance(value, dict),
          float: (_is_int(value) or isinstance(value, float))}[kind]
    if not ok:
        name = {bool: "a boolean", int: "an integer", float: "a number", dict: "an object"}[kind]
        raise bad_request(f"{key} must be {name}, got {json.dumps(value)[:40]}", key)
    return float(value) if kind is float else value


def _int32(field: str, value: int) -> int:
    if not _INT32[0] <= value <= _INT32[1]:
        raise bad_request(f"{field} must fit a 32-bit integer, got {value}", field)
    return value
