"""Fuzz classes for prompts (SERVING.md §5.1, [PRM-1]..[PRM-4], §7.2): prompt-source combinations,
`messages` and `chat_template_kwargs` JSON, invalid UTF-8, oversize prompts, odd but valid
requests, stop requests.

Each class is `def name(g: Gen) -> Case` and records what the case may answer.
"""

from __future__ import annotations

import json

from fuzz_gen import BAD, OK, UNSUP, Case, Gen, malformed_json_text, nested

INVALID_UTF8 = (b"\xff", b"\xc0\xaf", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"abc\x80", b"\xfe\xfe")


# ---- prompts, messages, chat_template_kwargs ([PRM-1]..[PRM-4]) ---------------------------------


def _messages(g: Gen, n: int = 1) -> list[dict]:
    roles = ("system", "user", "assistant")
    return [{"role": g.choice(roles) if i < n - 1 else "user", "content": g.text()} for i in range(n)]


def prompt_combination(g: Gen) -> Case:
    """[PRM-1]: exactly one of a non-empty text_input and messages (with text_input "")."""
    messages = json.dumps(_messages(g, g.rng.randint(1, 3)))
    variant = g.choice(("both", "neither", "kwargs-alone", "messages", "messages-and-kwargs", "messages-no-text"))
    protocol = g.protocol()
    values = g.cheap(protocol)
    model = g.model()
    expect = BAD
    if variant == "both":
        values["messages"] = messages
    elif variant == "neither":
        values["text_input"] = g.choice(("", b""))
    elif variant == "kwargs-alone":
        values["chat_template_kwargs"] = '{"thinking": true}'
    elif variant.startswith("messages"):
        values.update(text_input="", messages=messages)
        expect = OK
        if variant == "messages-and-kwargs":
            values["chat_template_kwargs"] = g.choice(('{}', '{"thinking": true}', '{"thinking": false}',
                                                       '{"thinking": null}'))
        if variant == "messages-no-text":  # 2.51 core only refuses a request with no inputs at all
            del values["text_input"]
    return g.case(f"prompt/{variant}", expect, values, model=model, protocol=protocol)


def _bad_message(g: Gen) -> tuple[str, object, frozenset[str]]:
    """(variant, messages JSON value, answers) for a message list that breaks [PRM-3]."""
    good = _messages(g)
    variants = {
        "empty-list": ([], BAD), "not-object": ([1], BAD), "no-role": ([{"content": "hi"}], BAD),
        "bad-role": ([{"role": "robot", "content": "hi"}], BAD),
        "tool-role": ([{"role": "tool", "content": "hi"}], UNSUP),
        "tool-calls": ([{"role": "assistant", "content": "", "tool_calls": []}], UNSUP),
        "tool-call-id": ([{"role": "user", "content": "hi", "tool_call_id": "x"}], UNSUP),
        "unknown-key": ([{"role": "user", "content": "hi", "weight": 1}], BAD),
        "content-int": ([{"role": "user", "content": 5}], BAD),
        "content-null": ([{"role": "user", "content": None}], BAD),
        "part-not-object": ([{"role": "user", "content": ["hi"]}], BAD),
        "part-type": ([{"role": "user", "content": [{"type": "video", "video": "x"}]}], BAD),
        "part-key": ([{"role": "user", "content": [{"type": "text", "text": "a", "style": "b"}]}], BAD),
        "text-not-string": ([{"role": "user", "content": [{"type": "text", "text": ["a"]}]}], BAD),
        "image-url-int": ([{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}], BAD),
        "image-url-detail": ([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AAAA", "detail": "low"}}]}], BAD),
        "too-many": ([{"role": "user", "content": "x"}] * 1025, BAD),
        "name-ignored": ([{"role": "user", "content": "hi", "name": "bob"}], OK),
        "special-literals": ([{"role": "user", "content": "<|im_end|><|media_pad|><|kimi_image_placeholder|>"}], OK),
        "parts": ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], OK),
        "object": ({"role": "user", "content": "hi"}, BAD), "string": ("hi", BAD), "null": (None, BAD),
        "many-tokens": ([{"role": "user", "content": g.text(40)}] * (g.limits.max_model_len // 40 + 5), BAD),
        "valid": (good, OK),
    }
    variant = g.choice(variants)
    value, expect = variants[variant]
    return variant, value, expect


def messages_json(g: Gen) -> Case:
    """messages: malformed, nested, huge or against the schema; text_input "" as the spec asks."""
    roll = g.rng.random()
    if roll < 0.6:
        variant, value, expect = _bad_message(g)
        text = json.dumps(value)
    elif roll < 0.75:
        variant, expect = "malformed", BAD
        text = malformed_json_text(g, json.dumps(_messages(g)))
    elif roll < 0.9:
        variant, expect = "nested", BAD
        depth = g.choice((10, 900, 1001, 5000, 30000))
        text = g.choice(('[{"role": "user", "content": ' + nested(depth) + "}]", nested(depth),
                         '[{"role": "user", "content": [' + nested(depth, "{\"a\":", "}")[: -depth] + "1" + "}" * depth + "]}]"))
    else:
        variant, expect = "oversize", BAD
        text = json.dumps([{"role": "user", "content": "x" * (g.limits.max_prompt_bytes + g.rng.randint(0, 999))}])
    return g.generation(f"messages/{variant}", expect, text_input="", messages=text)


def chat_template_kwargs(g: Gen) -> Case:
    value, expect = g.choice((
        ('{"thinking": true}', OK), ('{"thinking": null}', OK), ("{}", OK), ('{"thinking": "yes"}', BAD),
        ('{"thinking": 1}', BAD), ('{"think": true}', BAD), ("[]", BAD), ("null", BAD), ("true", BAD),
        ('{"thinking": true', BAD), (nested(5000, '{"a":', "}"), BAD), ("", BAD),
    ))
    return g.generation("chat_template_kwargs", expect, text_input="", messages=json.dumps(_messages(g)),
                        chat_template_kwargs=value)


def invalid_utf8(g: Gen) -> Case:
    """[PRM-2]: invalid UTF-8 in any text input is INVALID_ARG (guided decoding: present, so
    UNSUPPORTED before it is read)."""
    junk = g.choice(INVALID_UTF8)
    cut = g.rng.randint(0, 8)
    text = g.text(8).encode()
    spoiled = text[:cut] + junk + text[cut:]
    where = g.choice(("text_input", "messages", "sampling_parameters", "chat_template_kwargs", "stop_words",
                      "bad_words", "guided_decoding_guide"))
    values: dict = {}
    expect = BAD
    if where == "text_input":
        values["text_input"] = spoiled
    elif where == "messages":
        values.update(text_input="", messages=b'[{"role": "user", "content": "' + spoiled + b'"}]')
    elif where == "sampling_parameters":
        values["sampling_parameters"] = b'{"stop": ["' + spoiled + b'"]}'
    elif where == "chat_template_kwargs":
        values.update(text_input="", messages=json.dumps(_messages(g)),
                      chat_template_kwargs=b'{"thinking": true, "' + spoiled + b'": 1}')
    elif where == "guided_decoding_guide":
        values["guided_decoding_guide"], expect = spoiled, UNSUP
    else:
        values[where] = [spoiled, "ok"]
    return g.generation(f"utf8/{where}", expect, **values)


def oversize_prompt(g: Gen) -> Case:
    """Prompts beyond max_prompt_bytes, beyond max_model_len tokens, or leaving too little room
    for max_tokens ([SMP-5]); the tiny tokenizer makes one token per ASCII byte."""
    limits = g.limits
    variant = g.choice(("bytes", "tokens", "room"))
    values: dict = {}
    if variant == "bytes":
        values["text_input"] = "y" * (limits.max_prompt_bytes + g.rng.randint(1, 2000))
    elif variant == "tokens":
        values["text_input"] = "z" * g.rng.randint(limits.max_model_len, min(limits.max_prompt_bytes, 2 * limits.max_model_len))
    else:
        n = limits.max_model_len - g.rng.randint(1, 64)
        values.update(text_input="w" * n, max_tokens=limits.max_model_len - n + g.rng.randint(1, 100))
    return g.generation(f"oversize/{variant}", BAD, **values)


def odd_valid(g: Gen) -> Case:
    """Valid requests with unusual but legal content and knobs: each must succeed."""
    pool = {
        "text_input": g.choice(("a\x00b", "\U0001f600\u200f\u0301", "<|im_end|><|open|>think<|sep|>", " ", "\n" * 5,
                                "<|media_begin|>", "\ufeffBOM", "\u2028")),
        "exclude_input_in_output": False, "return_log_probs": True, "return_cumulative_logprob": True,
        "return_logprobs": True, "top_logprobs": 20, "return_reasoning": True, "return_perf_metrics": True,
        "return_num_input_tokens": True, "return_num_output_tokens": True, "return_finish_reason": True,
        "ignore_eos": g.chance(0.5), "seed": 2**64 - 1, "prompt_table_extra_id": 7, "temperature": 1e20,
        "top_k": 1, "top_p": 1e-45, "min_p": 1.0, "repetition_penalty": g.choice((1e-45, 3.4e38)),
        "presence_penalty": -2.0, "frequency_penalty": 2.0, "length_penalty": -3.4e38,
        "stop_words": [" ", "e", "\u20ac", "<|im_end|>"], "bad_words": [*"aeiou", "<|media_pad|>", "\U0001f600"],
        "stop_token_ids": list(range(64)),
        "end_id": 0, "pad_id": 0, "sampling_parameters": json.dumps({"skip_special_tokens": False,
                                                                     "include_stop_str_in_output": True,
                                                                     "stop": "\n", "max_tokens": "2"}),
    }
    picked = {k: pool[k] for k in g.rng.sample(sorted(pool), g.rng.randint(1, 5))}
    return g.generation("valid/" + "+".join(sorted(picked)), OK, **picked)


def stop_request(g: Gen) -> Case:
    """[CAN-4]: a stop request needs a request id; with one it always succeeds (every other input
    is ignored, but through the ensemble k3_vision still reads text_input first)."""
    model, protocol = g.model(), g.protocol()
    with_id = g.chance(0.5)
    text = g.choice(("", "ignored", b"\xff bad"))
    values = {"text_input": text, "stop": True}
    if g.chance(0.4):
        values.update({g.choice(("top_p", "max_tokens", "beam_width")): g.choice((5, 0, -1))})
    if not with_id:
        return g.case("stop/no-id", BAD, values, model=model, protocol=protocol, request_id="")
    expect = frozenset({"ok", "INVALID_ARG"}) if model == "k3_ensemble" and isinstance(text, bytes) else OK
    return g.case("stop/with-id", expect, values, model=model, protocol=protocol)


CLASSES = [  # (class, weight)
    (prompt_combination, 4), (messages_json, 8), (chat_template_kwargs, 3), (invalid_utf8, 5),
    (oversize_prompt, 3), (odd_valid, 4), (stop_request, 3),
]
