"""Fuzz classes for sampling and termination values (SERVING.md §2.2, §5.3, [SMP-1]..[SMP-4]).

Each class is `def name(g: Gen) -> Case` and records what the case may answer. Numbers are
judged by the §2.2 ranges (`FLOAT_RANGES`, `INT_RULES`) and the [SMP-3] type rule: a JSON value
is accepted exactly when the field's tensor type could carry it (numbers may be spelled as JSON
strings); spellings the spec leaves open accept either answer.
"""

from __future__ import annotations

import json
import math

import numpy as np

from fuzz_gen import BAD, OK, PARSE, UNSUP, Case, Gen, malformed_json_text, nested

FP32_MAX = float(np.finfo(np.float32).max)

# ---- number rules: §2.2 ranges --------------------------------------------------------------------

FLOAT_RANGES = {
    "temperature": lambda v: math.isfinite(v) and v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: math.isfinite(v) and v > 0,
    "presence_penalty": lambda v: -2 <= v <= 2,
    "frequency_penalty": lambda v: -2 <= v <= 2,
    "length_penalty": math.isfinite,  # a tensor only, not a sampling_parameters key
}
FLOATS = (0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000002, -1.0, -2.0, -2.5, 1e-45, 1e-38, 1e-30, 1e-6, 1e-5, 1e20,
          3.4e38, -3.4e38, math.inf, -math.inf, math.nan)


def _unit(lo: int, hi: int):
    return lambda v, limits: "ok" if lo <= v <= hi else "INVALID_ARG"


def _one(v: int, limits) -> str:  # beam_width, num_return_sequences
    return "ok" if v == 1 else ("UNSUPPORTED" if v > 1 else "INVALID_ARG")


# (candidate values, rule(value, limits) -> answer). max_tokens stays tiny when valid: cheap cases.
INT_RULES = {
    "max_tokens": ((-2**31, -1, 0, 1, 2, 3, "L", "L+1", 2**31 - 1),
                   lambda v, limits: "ok" if 1 <= v <= 3 else "INVALID_ARG"),
    "top_k": ((-2**31, -2, -1, 0, 1, 2, 511, 512, 513, 2**31 - 1),
              lambda v, limits: "ok" if v >= -1 else "INVALID_ARG"),
    "end_id": ((-2**31, -1, 0, 258, "V-1", "V", 2**31 - 1),
               lambda v, limits: "ok" if 0 <= v < limits.vocab_size else "INVALID_ARG"),
    "pad_id": ((-1, 0, "V-1", "V"), lambda v, limits: "ok" if 0 <= v < limits.vocab_size else "INVALID_ARG"),
    "top_logprobs": ((-2**31, -1, 0, 1, 20, 21, 2**31 - 1), _unit(0, 20)),
    "beam_width": ((-2**31, -1, 0, 1, 2, 4, 2**31 - 1), _one),
    "num_return_sequences": ((-1, 0, 1, 2, 2**31 - 1), _one),
}
UINT64_VALUES = (0, 1, 2**32, 2**63, 2**64 - 1)  # seed, random_seed, prompt_table_extra_id: any value


def _resolve(v, limits) -> int:
    """Symbolic candidates: L = max_model_len, V = vocab size."""
    if isinstance(v, int):
        return v
    base = limits.max_model_len if v[0] == "L" else limits.vocab_size
    return base + (int(v[1:]) if len(v) > 1 else 0)


def _fp32(v: float) -> float:
    with np.errstate(over="ignore"):
        return float(str(np.float32(v)))  # what the model reads from an FP32 tensor


# ---- tensor values ----------------------------------------------------------------------------


def tensor_value(g: Gen) -> Case:
    """One sampling or output knob as a typed tensor (gRPC) or top-level JSON value (/generate)."""
    protocol = g.protocol()
    kind = g.choice(("float", "int", "uint64"))
    if kind == "float":
        name = g.choice(FLOAT_RANGES)
        value = g.choice(FLOATS)
        expect = "ok" if FLOAT_RANGES[name](_fp32(value)) else "INVALID_ARG"
    elif kind == "int":
        name = g.choice(INT_RULES)
        candidates, rule = INT_RULES[name]
        value = _resolve(g.choice(candidates), g.limits)
        expect = rule(value, g.limits)
    else:
        name, value, expect = g.choice(("seed", "random_seed", "prompt_table_extra_id")), g.choice(UINT64_VALUES), "ok"
    values = g.cheap(protocol, **{name: value})
    if name == "top_logprobs":
        values["return_logprobs"] = g.chance(0.5)
    return g.case(f"tensor/{name}", frozenset({expect}), values, protocol=protocol)


def min_tokens_rule(g: Gen) -> Case:
    """min_tokens (or its alias min_length) against max_tokens: 0 <= min <= max ([SMP-5])."""
    max_tokens = g.rng.randint(1, 3)
    value = g.choice((-2**31, -1, 0, 1, max_tokens, max_tokens + 1, 2**31 - 1))
    name = g.choice(("min_tokens", "min_length"))
    expect = OK if 0 <= value <= max_tokens else BAD
    return g.generation(f"tensor/{name}", expect, max_tokens=max_tokens, ignore_eos=g.chance(0.5), **{name: value})


def alias_conflict(g: Gen) -> Case:
    """[SMP-2]: both names of an alias pair, equal (fine) or different (INVALID_ARG)."""
    pair = g.choice((("min_tokens", "min_length"), ("seed", "random_seed")))
    a = g.rng.randint(0, 2)
    b = a if g.chance(0.4) else a + g.rng.randint(1, 2 if pair[0] == "min_tokens" else 2**40)
    if pair[0] == "min_tokens":
        extra = {"max_tokens": 3, "min_tokens": min(a, 3), "min_length": min(b, 3)}
        same = extra["min_tokens"] == extra["min_length"]
    else:
        extra, same = {"seed": a, "random_seed": b}, a == b
    return g.generation(f"alias/{pair[0]}", OK if same else BAD, **extra)


def http_json_kind(g: Gen) -> Case:
    """/generate with a JSON value of the wrong kind for its tensor: Triton's own parser answers
    500 "Unable to parse 'data'" before any model runs (README "Error status codes")."""
    name, value = g.choice((
        ("max_tokens", "3"), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", None), ("max_tokens", {"v": 1}),
        ("temperature", "0.5"), ("temperature", True), ("top_k", 1e20), ("seed", -1), ("seed", 1.5),
        ("stream", "yes"), ("stream", 1), ("ignore_eos", "true"), ("stop_token_ids", [1, "a"]),
        ("stop_words", [1]), ("text_input", 5), ("text_input", None), ("sampling_parameters", {"temperature": 0}),
        ("messages", [{"role": "user", "content": "hi"}]),
    ))
    protocol = g.choice(("http_generate", "http_stream"))
    values = g.cheap(protocol, **{name: value})
    return g.case(f"http_kind/{name}", PARSE, values, protocol=protocol)


# ---- sampling_parameters JSON ([SMP-3]) --------------------------------------------------------

JSON_INT_KEYS = {"max_tokens": INT_RULES["max_tokens"], "min_tokens": ((-1, 0, 1, 3, 4), _unit(0, 3)),
                 "top_k": INT_RULES["top_k"], "logprobs": INT_RULES["top_logprobs"],
                 "n": ((0, 1, 2, -1), lambda v, limits: "ok" if v == 1 else "UNSUPPORTED"),
                 "best_of": ((0, 1, 3), lambda v, limits: "ok" if v == 1 else "UNSUPPORTED")}
JSON_FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
JSON_BOOL_KEYS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "detokenize")
NOT_A_NUMBER = (True, False, "true", "", "NaN", "nan", "Infinity", "-inf", "0x10", "1_0", "\u0663", "0.5f", "1,5",
                [1], {"v": 1})
NOT_A_BOOL = (1, 0, "1", "yes", "", [True], {"v": True}, 0.0)
UNSUPPORTED_KEYS = {"prompt_logprobs": 1, "logit_bias": {"1": 5.0}, "allowed_token_ids": [1, 2],
                    "structured_outputs": {"json": {}}, "guided_decoding": {"regex": "a+"}, "lora_name": "x",
                    "truncate_prompt_tokens": 5}


def _json_number(g: Gen) -> tuple[str, object, frozenset[str]]:
    """(key, JSON value, answers) for a numeric sampling_parameters key."""
    if g.chance(0.5):
        key = g.choice(JSON_INT_KEYS)
        candidates, rule = JSON_INT_KEYS[key]
        v = _resolve(g.choice(candidates), g.limits)
        answer = rule(v, g.limits)
        spelled = g.choice((v, str(v), float(v)))  # [SMP-3]: a string spelled as a number is the number
        if g.chance(0.3):
            spelled, answer = g.choice((2.5, "2.5", 1e20, "1e20", 2**31, 2**64, "9" * 5000, *NOT_A_NUMBER)), "INVALID_ARG"
        return key, spelled, frozenset({answer})
    key = g.choice(JSON_FLOAT_KEYS)
    v = g.choice((*FLOATS, 1e39, -1e39))
    ok = FLOAT_RANGES[key](v) and not (math.isfinite(v) and abs(v) > FP32_MAX)
    spelled = str(v) if g.chance(0.3) and math.isfinite(v) else v
    answer = "ok" if ok else "INVALID_ARG"
    if g.chance(0.3):
        spelled, answer = g.choice((*NOT_A_NUMBER, "9" * 5000)), "INVALID_ARG"
    return key, spelled, frozenset({answer})


def _json_value(g: Gen) -> tuple[str, object, frozenset[str]]:
    roll = g.rng.random()
    if roll < 0.5:
        return _json_number(g)
    if roll < 0.7:
        key = g.choice(JSON_BOOL_KEYS)
        value = g.choice((True, False, "true", "false", *NOT_A_BOOL))
        valid = isinstance(value, bool) or value in ("true", "false")
        if not valid:
            return key, value, BAD
        meant = value if isinstance(value, bool) else value == "true"
        return key, value, UNSUP if key == "detokenize" and not meant else OK
    if roll < 0.85:
        key = g.choice(UNSUPPORTED_KEYS)
        return (key, None, OK) if g.chance(0.3) else (key, UNSUPPORTED_KEYS[key], UNSUP)
    key, value = g.choice((("temprature", 0.5), ("max_new_tokens", 3), ("", 1), ("stop_sequences", ["x"]),
                           ("Temperature", 0.5), ("seed ", 1)))
    return key, value, BAD


def sampling_value(g: Gen) -> Case:
    """One key of sampling_parameters with an interesting or wrongly typed value. The tensor of
    the same name is left out: it would take precedence ([SMP-1]) and hide the JSON value."""
    key, value, expect = _json_value(g)
    protocol = g.protocol()
    values = g.cheap(protocol)
    values.pop(key, None)
    if key == "min_tokens":
        values["max_tokens"] = 3
    values["sampling_parameters"] = json.dumps({key: value})
    return g.case(f"sampling/{key or 'empty-key'}", expect, values, protocol=protocol)


def seed_json(g: Gen) -> Case:
    value = g.choice((-1, 0, 2**64 - 1, 2**64, "18446744073709551615", "-1", 1.5, "x"))
    ok = isinstance(value, (int, str)) and str(value).lstrip("-").isdigit() and 0 <= int(value) < 2**64
    return g.generation("sampling/seed", OK if ok else BAD, sampling_parameters=json.dumps({"seed": value}))


def sampling_shape(g: Gen) -> Case:
    """sampling_parameters that is no JSON object: malformed, nested, huge, another JSON kind."""
    variant = g.choice(("malformed", "nested", "huge", "kind", "duplicate", "null-values", "bigint"))
    expect = BAD
    if variant == "malformed":
        sp = malformed_json_text(g, json.dumps({"temperature": 0}))
    elif variant == "nested":
        depth = g.choice((50, 500, 990, 1001, 5000, 20000))
        sp = json.dumps({"stop": "x"})[:-1] + ', "stop_token_ids": ' + nested(depth) + "}"
    elif variant == "huge":
        sp = '{"temperature": 0' + " " * (64 * 1024 + g.rng.randint(0, 4000)) + "}"
    elif variant == "bigint":  # beyond Python's int digit limit: json.loads raises ValueError
        sp = '{"top_k": ' + "9" * 5000 + "}"
    elif variant == "kind":
        sp = g.choice(("[]", '"x"', "1", "null", "true", '[{"temperature": 0}]'))
    elif variant == "duplicate":  # the last value wins in Python; the spec says nothing
        sp, expect = '{"temperature": 0, "temperature": 0.5}', frozenset({"ok", "INVALID_ARG"})
    else:
        sp, expect = json.dumps({k: None for k in ("max_tokens", "temperature", "stop", "n", "logit_bias")}), OK
    return g.generation(f"sampling/{variant}", expect, sampling_parameters=sp)


# ---- stop words, bad words, stop ids ([SMP-3] limits, §2.2) -------------------------------------


def _words(g: Gen, count: int, size: int) -> list[str]:
    unit = g.choice(("a", "\u20ac", "\U0001f600"))  # 1, 3 or 4 bytes per character
    reps = max(1, size // len(unit.encode()))
    return [unit * reps if i == 0 else g.text(g.rng.randint(1, 8)) for i in range(count)]


def word_limits(g: Gen) -> Case:
    """stop_words (32 x 1-256 bytes), bad_words (256 x 1-256 bytes), stop_token_ids (64 ids in
    [0, vocab)): at, below and beyond each limit, as tensors or as sampling_parameters lists."""
    field_ = g.choice(("stop_words", "bad_words", "stop_token_ids"))
    as_json = g.chance(0.4)
    if field_ == "stop_token_ids":
        count = g.choice((0, 1, 64, 65))
        bad_id = g.choice((None, -1, g.limits.vocab_size, 2**31 - 1))
        ids = [g.rng.randrange(g.limits.vocab_size) for _ in range(count)]
        if bad_id is not None and ids:
            ids[g.rng.randrange(count)] = bad_id
        ok = count <= 64 and (bad_id is None or not ids)
        values = {"sampling_parameters": json.dumps({"stop_token_ids": ids})} if as_json else {"stop_token_ids": ids}
        return g.generation(f"words/stop_token_ids{'/json' if as_json else ''}", OK if ok else BAD, **values)
    limit = 32 if field_ == "stop_words" else 256
    count = g.choice((1, 2, limit, limit + 1))
    size = g.choice((0, 1, 255, 256, 257))
    words = _words(g, count, size) if size else [""] + [g.text(3) for _ in range(count - 1)]
    first = len(words[0].encode())
    ok = count <= limit and 1 <= first <= 256
    key = "stop" if field_ == "stop_words" else "bad_words"
    values = {"sampling_parameters": json.dumps({key: words})} if as_json else {field_: words}
    return g.generation(f"words/{field_}{'/json' if as_json else ''}", OK if ok else BAD, **values)


def unsupported_knob(g: Gen) -> Case:
    """UNSUPPORTED features (§7.2): beams, several sequences, logits, guided decoding."""
    name, value = g.choice((("beam_width", 2), ("beam_width", 8), ("num_return_sequences", 3),
                            ("return_context_logits", True), ("return_generation_logits", True),
                            ("guided_decoding_guide_type", "json"), ("guided_decoding_guide", '{"type": "object"}')))
    if g.chance(0.25):  # off, empty or 1: accepted
        value = {"beam_width": 1, "num_return_sequences": 1}.get(name, "" if isinstance(value, str) else False)
        return g.generation(f"unsupported/{name}-off", OK, **{name: value})
    return g.generation(f"unsupported/{name}", UNSUP, **{name: value})


def request_parameter(g: Gen) -> Case:
    """[SMP-1] level 3: /generate turns a body key that is no input name into a request
    parameter; accepted keys are held to their type, others are ignored ([SMP-4])."""
    name, value, expect = g.choice((
        ("n", 2, UNSUP), ("best_of", 2, UNSUP), ("detokenize", False, UNSUP), ("n", 1, OK),
        ("logprobs", 30, BAD), ("include_stop_str_in_output", "maybe", BAD), ("skip_special_tokens", False, OK),
        ("spaces_between_special_tokens", True, OK), ("client_tag", "x" * 5000, OK), ("priority", 3, OK),
        ("logit_bias", "x", frozenset({"ok", "UNSUPPORTED"})), ("temprature", 0.5, OK),
        ("nested", {"a": [1]}, frozenset({"TRITON"})), ("list", [1, 2], frozenset({"TRITON"})),
        ("nothing", None, frozenset({"TRITON"})),
    ))
    protocol = g.choice(("http_generate", "http_stream"))
    return g.case(f"param/{name}", expect, g.cheap(protocol, **{name: value}), protocol=protocol)


CLASSES = [  # (class, weight)
    (tensor_value, 10), (min_tokens_rule, 3), (alias_conflict, 3), (http_json_kind, 3), (sampling_value, 10),
    (seed_json, 2), (sampling_shape, 5), (word_limits, 5), (unsupported_knob, 4), (request_parameter, 3),
]
