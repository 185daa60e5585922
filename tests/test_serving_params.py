"""serving.params + serving.prompt: request tensors -> ParsedRequest -> engine Request (SERVING.md §2.2, §4.2, §5.1-5.5, §6.3).

Inputs are built as Triton delivers them: numpy arrays with the batch dimension of 1, fetched
through a fake `get`. Each test names the SERVING.md rule it checks.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from k3backend.errors import InvalidArgument, Unsupported
from k3backend.serving.params import (
    LmDefaults,
    ParsedRequest,
    load_generation_defaults,
    parse_request,
)
from k3backend.serving.prompt import bad_word_sequences, build_request, ends_in_think
from k3backend.tokenizer import IMAGE_PLACEHOLDER_TEXT, Tokenizer, write_tiny_tokenizer

HIDDEN = 8
VOCAB = 512  # the tiny byte-level vocabulary: 256 ranks + 256 specials
DEFAULTS = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN)
EOS = (258,)

# Triton dtypes of the §2.2 / §2.4 inputs (BYTES as object arrays of bytes).
BYTES = object
DTYPES: dict[str, Any] = {
    **dict.fromkeys(["text_input", "messages", "chat_template_kwargs", "sampling_parameters",
                     "guided_decoding_guide_type", "guided_decoding_guide", "stop_words", "bad_words",
                     "image_hashes"], BYTES),
    **dict.fromkeys(["max_tokens", "min_tokens", "min_length", "end_id", "pad_id", "top_k", "beam_width",
                     "num_return_sequences", "top_logprobs", "stop_token_ids", "image_token_counts",
                     "image_sizes"], np.int32),
    **dict.fromkeys(["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"], np.float32),
    **dict.fromkeys(["seed", "random_seed", "prompt_table_extra_id"], np.uint64),
    **dict.fromkeys(["ignore_eos", "stream", "exclude_input_in_output", "return_finish_reason",
                     "return_num_input_tokens", "return_num_output_tokens", "return_log_probs",
                     "return_cumulative_logprob", "return_logprobs", "return_reasoning",
                     "return_perf_metrics", "return_context_logits", "return_generation_logits",
                     "stop"], np.bool_),
    "image_grid_thw": np.int64,
}
LISTS = {"stop_words", "bad_words", "stop_token_ids", "image_hashes", "image_token_counts"}


def _tensor(name: str, value: Any) -> np.ndarray | torch.Tensor:
    """`value` as Triton hands it to the model: with the leading batch dimension of 1."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value[None]
    dtype = DTYPES[name]
    values = list(value) if name in LISTS else [value]
    if dtype is BYTES:
        arr = np.empty((1, len(values)), dtype=object)
        for i, v in enumerate(values):
            arr[0, i] = v.encode() if isinstance(v, str) else v
        return arr
    if name in ("image_grid_thw", "image_sizes"):
        return np.array([value], dtype=dtype)
    return np.array([values], dtype=dtype)


def tensors(**inputs: Any) -> dict[str, Any]:
    return {name: _tensor(name, value) for name, value in inputs.items()}


def parse(parameters: dict[str, Any] | None = None, request_id: str = "r1", defaults: LmDefaults = DEFAULTS,
          **inputs: Any) -> ParsedRequest:
    arrays = tensors(**inputs)
    return parse_request(arrays.get, parameters or {}, request_id, defaults)


def sp(**keys: Any) -> str:
    return json.dumps(keys)


def user(content: Any) -> str:
    return json.dumps([{"role": "user", "content": content}])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


def build(tok: Tokenizer, parsed: ParsedRequest, max_model_len: int = 4096, default_max_tokens: int = 16):
    return build_request(parsed, tok, eos_ids=EOS, max_model_len=max_model_len, default_max_tokens=default_max_tokens)


def images(n_tokens: tuple[int, ...] = (4,), hidden: int = HIDDEN, **overrides: Any) -> dict[str, Any]:
    """Valid precomputed image inputs: image i has an (2·k)×2 grid, k·... chosen so N_i = h·w/4."""
    grids = [(1, 2 * n, 2) for n in n_tokens]  # h·w/4 = n
    data = {
        "image_embeds": np.random.default_rng(0).standard_normal((sum(n_tokens), hidden)).astype(np.float32),
        "image_token_counts": list(n_tokens),
        "image_grid_thw": np.array(grids, dtype=np.int64),
        "image_sizes": np.array([(28 * w, 28 * h) for _, h, w in grids], dtype=np.int32),
        "image_hashes": [f"{i:032x}" for i in range(len(n_tokens))],
    }
    data.update(overrides)
    return data


# ---- prompt sources ------------------------------------------------------------------------------


def test_PRM1_text_and_messages_is_invalid_arg():
    with pytest.raises(InvalidArgument, match="either in text_input or in messages"):
        parse(text_input="hi", messages=user("hi"))


def test_PRM1_no_prompt_is_invalid_arg():
    with pytest.raises(InvalidArgument, match="empty prompt"):
        parse(text_input="")


def test_PRM1_messages_with_empty_text_input():
    parsed = parse(text_input="", messages=user("hi"))
    assert parsed.text_input is None and parsed.messages == [{"role": "user", "content": "hi"}]


def test_PRM2_invalid_utf8_names_the_byte():
    with pytest.raises(InvalidArgument, match="^text_input is not valid UTF-8 at byte 3$"):
        parse(text_input=b"abc\xff")


def test_PRM2_text_input_verbatim_with_special_literals(tok: Tokenizer):
    request, echo = build(tok, parse(text_input="a<|open|>b"))
    assert request.prompt_ids == [ord("a"), tok.id_of("<|open|>"), ord("b")]  # nothing added
    assert echo == "a<|open|>b"


def test_PRM2_max_prompt_bytes():
    small = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, max_prompt_bytes=8)
    parse(defaults=small, text_input="12345678")
    with pytest.raises(InvalidArgument, match="text_input is 9 bytes; max_prompt_bytes is 8"):
        parse(defaults=small, text_input="123456789")
    with pytest.raises(InvalidArgument, match="messages is .* bytes; max_prompt_bytes is 8"):
        parse(defaults=small, text_input="", messages=user("hello"))


@pytest.mark.parametrize("messages, match", [
    ("{}", "messages must be a JSON array"),
    ("[]", "1 to 1024 messages, got 0"),
    (json.dumps([{"role": "user", "content": "x"}] * 1025), "1 to 1024 messages, got 1025"),
    ("[1]", r"messages\[0\] must be an object"),
    ('[{"role": "user", "content": "x"', "messages is not valid JSON: Expecting"),
    (json.dumps([{"role": "robot", "content": "x"}]), "role must be system, user or assistant, got 'robot'"),
    (json.dumps([{"role": "user", "content": "x", "foo": 1}]), r"messages\[0\]: unknown key 'foo'"),
    (json.dumps([{"role": "user"}]), "content must be a string or a list of parts, got NoneType"),
    (json.dumps([{"role": "user", "content": [{"type": "video"}]}]), "unknown part type 'video'"),
    (json.dumps([{"role": "user", "content": [{"type": "text", "text": 3}]}]), "text must be a string"),
    (json.dumps([{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]), "unknown key 'x'"),
    (json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "hi"}}]}]),
     "image_url must be"),
    (json.dumps([{"role": "user", "content": ["text"]}]), r"content\[0\] must be an object"),
    ("[" * 100000, "messages is not valid JSON"),  # hostile nesting is a client error, not INTERNAL
], ids=["object", "empty", "too-many", "not-object", "bad-json", "role", "unknown-key", "no-content",
        "part-type", "text-type", "part-key", "image-url-key", "part-string", "deep-nesting"])
def test_PRM3_messages_schema_invalid_arg(messages: str, match: str):
    with pytest.raises(InvalidArgument, match=match):
        parse(text_input="", messages=messages)


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "x", "tool_call_id": "1"},
    {"role": "tool", "content": "x"},
    {"role": "assistant", "content": "", "tool_calls": []},
    {"role": "user", "content": "x", "tool_call_id": "1"},
], ids=["tool-role-with-id", "tool-role", "tool_calls", "tool_call_id"])
def test_PRM3_tool_calling_is_unsupported(message: dict):
    with pytest.raises(Unsupported, match="tool"):
        parse(text_input="", messages=json.dumps([message]))


def test_PRM3_name_is_ignored_and_all_roles_accepted():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "bob"},
                {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
    assert parse(text_input="", messages=json.dumps(messages)).messages == messages


def test_chat_template_kwargs_needs_messages():
    with pytest.raises(InvalidArgument, match="chat_template_kwargs is only allowed with messages"):
        parse(text_input="hi", chat_template_kwargs='{"thinking": true}')


@pytest.mark.parametrize("kwargs, match", [
    ('{"enable_thinking": true}', "unknown key 'enable_thinking' in chat_template_kwargs"),
    ('{"thinking": "maybe"}', "thinking must be true or false"),
    ("[]", "chat_template_kwargs must be a JSON object"),
    ("{", "chat_template_kwargs is not valid JSON"),
])
def test_chat_template_kwargs_invalid(kwargs: str, match: str):
    with pytest.raises(InvalidArgument, match=match):
        parse(text_input="", messages=user("hi"), chat_template_kwargs=kwargs)


def test_PRM4_thinking_from_kwargs_then_default(tok: Tokenizer):
    assert parse(text_input="", messages=user("hi"), chat_template_kwargs='{"thinking": true}').thinking
    assert not parse(text_input="", messages=user("hi"), chat_template_kwargs='{"thinking": null}').thinking
    on = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, default_thinking=True)
    parsed = parse(defaults=on, text_input="", messages=user("hi"))
    request, echo = build(tok, parsed)
    assert parsed.thinking and echo.endswith("<|open|>think<|sep|>") and ends_in_think(request.prompt_ids, tok)


def test_PRM4_chat_rendering_and_user_text_never_special(tok: Tokenizer):
    request, echo = build(tok, parse(text_input="", messages=user("<|open|>")))
    assert echo == ('<|open|>message role="user"<|sep|><|open|><|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert request.prompt_ids.count(tok.id_of("<|open|>")) == 3  # the user's literal stayed text
    assert not ends_in_think(request.prompt_ids, tok)


def test_TXT3_in_think(tok: Tokenizer):
    request, _ = build(tok, parse(text_input="x<|open|>think<|sep|>", return_reasoning=True))
    assert ends_in_think(request.prompt_ids, tok)
    request, _ = build(tok, parse(text_input="<|open|>think<|sep|>a<|close|>think<|sep|>"))
    assert not ends_in_think(request.prompt_ids, tok)
    assert ends_in_think(tok.encode("<|open|>think<|sep|>prefilled", allow_special=True), tok)
    assert not ends_in_think(tok.encode("<|open|>think", allow_special=True), tok)  # unfinished markup


def test_TXT3_in_think_follows_the_last_markup_of_any_prompt(tok: Tokenizer):
    """Random id sequences of markup and text against the definition: the last <|open|> or <|close|>
    is an <|open|> whose element name, up to the next <|sep|>, is `think`."""
    import random

    o, c, sep = (tok.id_of(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))
    think, other = tok.encode("think", allow_special=False), tok.encode("message", allow_special=False)
    units = [[o], [c], [sep], think, other, [5], [o, *think, sep], [o, *other, sep]]
    rng = random.Random(0)
    for _ in range(400):
        ids = [t for _ in range(rng.randrange(0, 12)) for t in rng.choice(units)]
        last = max((i for i, t in enumerate(ids) if t in (o, c)), default=None)
        tail = ids[last + 1:] if last is not None else []
        want = (last is not None and ids[last] == o and sep in tail
                and tok.decode(tail[:tail.index(sep)]).split()[:1] == ["think"])
        assert ends_in_think(ids, tok) == want and ends_in_think(tuple(ids), tok) == want, ids


# ---- stop requests (§6.3) ------------------------------------------------------------------------


def test_CAN3_stop_request_ignores_other_inputs():
    parsed = parse(request_id="job-42", text_input="", stop=True, sampling_parameters="not json", top_p=7.0)
    assert parsed.is_stop and parsed.request_id == "job-42"


def test_CAN4_stop_request_needs_a_request_id():
    with pytest.raises(InvalidArgument, match="^a stop request needs a request id$"):
        parse(request_id="", text_input="", stop=True)


def test_CAN4_stop_request_disabled_is_unsupported():
    off = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, allow_stop_by_request_id=False)
    with pytest.raises(Unsupported, match="allow_stop_by_request_id"):
        parse(defaults=off, request_id="job", text_input="", stop=True)


def test_stop_false_is_a_generation_request():
    assert not parse(text_input="hi", stop=False).is_stop


# ---- tensors and batch dimension -----------------------------------------------------------------


def test_batch_larger_than_one_is_invalid_arg():
    arrays = {"text_input": np.array([[b"a"], [b"b"]], dtype=object)}
    with pytest.raises(InvalidArgument, match=r"text_input: expected a batch dimension of 1, got shape \[2, 1\]"):
        parse_request(arrays.get, {}, "r", DEFAULTS)


def test_scalar_with_several_values_is_invalid_arg():
    arrays = tensors(text_input="a")
    arrays["max_tokens"] = np.array([[1, 2]], dtype=np.int32)
    with pytest.raises(InvalidArgument, match="max_tokens must hold exactly one value"):
        parse_request(arrays.get, {}, "r", DEFAULTS)


def test_torch_tensor_inputs_are_accepted():
    """The adapter hands GPU-resident inputs over through DLPack, as torch tensors."""
    arrays = {**tensors(text_input="a"), "max_tokens": torch.tensor([[7]], dtype=torch.int32),
              "ignore_eos": torch.tensor([[True]]), "top_p": torch.tensor([[0.5]])}
    parsed = parse_request(arrays.get, {}, "r", DEFAULTS)
    assert (parsed.max_tokens, parsed.sampling.ignore_eos, parsed.sampling.top_p) == (7, True, 0.5)


def test_fp32_values_keep_their_decimal_meaning():
    assert parse(text_input="a", temperature=0.7, top_p=0.9).sampling.temperature == 0.7


# ---- resolution order and aliases ([SMP-1], [SMP-2], [SMP-4]) ------------------------------------


def test_SMP1_tensor_beats_json_beats_parameter_beats_generation_config():
    gen = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, temperature=0.5, top_p=0.8, top_k=40, min_p=0.1,
                     repetition_penalty=1.2)
    params = {"temperature": 0.3, "top_p": 0.6, "top_k": 30}
    s = parse(params, defaults=gen, text_input="a", temperature=0.1,
              sampling_parameters=sp(temperature=0.2, top_p=0.7)).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.1, 0.7, 30, 0.1, 1.2)


def test_SMP1_section_2_2_defaults():
    parsed = parse(text_input="a")
    s = parsed.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens, s.seed, s.ignore_eos) == (0.0, 0.0, 0, None, False)
    assert (s.stop, s.stop_token_ids, s.bad_words, s.end_id) == ((), (), (), None)
    assert s.skip_special_tokens and not s.include_stop_str_in_output and s.logprobs is None
    assert parsed.max_tokens is None


def test_SMP1_request_parameters_with_vllm_names():
    s = parse({"max_tokens": "7", "stop": ["x"], "ignore_eos": True, "seed": 3}, text_input="a")
    assert (s.max_tokens, s.sampling.stop, s.sampling.ignore_eos, s.sampling.seed) == (7, ("x",), True, 3)


def test_SMP4_unknown_request_parameters_are_ignored():
    parsed = parse({"min_length": "nonsense", "triton_enable_empty_final_response": True, "foo": [1]},
                   text_input="a")
    assert parsed.sampling.min_tokens == 0


def test_SMP1_bad_request_parameter_value_is_invalid_arg():
    with pytest.raises(InvalidArgument, match="request parameter 'temperature' must be a number, got 'hot'"):
        parse({"temperature": "hot"}, text_input="a")


def test_SMP2_min_tokens_and_min_length_disagree():
    with pytest.raises(InvalidArgument, match=r"^min_tokens \(20\) and min_length \(10\) disagree$"):
        parse(text_input="a", max_tokens=30, min_tokens=20, min_length=10)


def test_SMP2_aliases_agree_or_stand_alone():
    assert parse(text_input="a", max_tokens=30, min_tokens=20, min_length=20).sampling.min_tokens == 20
    assert parse(text_input="a", max_tokens=30, min_length=12).sampling.min_tokens == 12
    assert parse(text_input="a", random_seed=9).sampling.seed == 9


def test_SMP2_seed_and_random_seed_disagree():
    with pytest.raises(InvalidArgument, match=r"seed \(1\) and random_seed \(2\) disagree"):
        parse(text_input="a", seed=1, random_seed=2)


def test_SMP2_list_tensor_replaces_json_list():
    s = parse(text_input="a", stop_words=["x"], bad_words=["y"], stop_token_ids=[5],
              sampling_parameters=sp(stop=["p", "q"], bad_words=["r"], stop_token_ids=[6, 7])).sampling
    assert (s.stop, s.bad_words, s.stop_token_ids) == (("x",), ("y",), (5,))


# ---- sampling_parameters ([SMP-3]) ---------------------------------------------------------------


def test_SMP3_malformed_json_message():
    with pytest.raises(InvalidArgument,
                       match="^sampling_parameters is not valid JSON: Expecting ',' delimiter at line 1 column 17$"):
        parse(text_input="a", sampling_parameters='{"max_tokens":1 "x":2}')


def test_SMP3_must_be_an_object():
    with pytest.raises(InvalidArgument, match="sampling_parameters must be a JSON object, got list"):
        parse(text_input="a", sampling_parameters="[1]")


def test_SMP3_unknown_key_is_invalid_arg():
    with pytest.raises(InvalidArgument, match="^unknown key 'temprature' in sampling_parameters$"):
        parse(text_input="a", sampling_parameters=sp(temprature=0.5))


@pytest.mark.parametrize("key", ["prompt_logprobs", "logit_bias", "allowed_token_ids", "structured_outputs",
                                 "guided_decoding", "lora_name", "truncate_prompt_tokens"])
def test_SMP3_unsupported_keys(key: str):
    with pytest.raises(Unsupported, match=key):
        parse(text_input="a", sampling_parameters=json.dumps({key: 1}))
    parse(text_input="a", sampling_parameters=json.dumps({key: None}))  # null is fine


def test_SMP3_numbers_and_booleans_as_strings():
    parsed = parse(text_input="a", sampling_parameters=sp(
        max_tokens="128", min_tokens="4", temperature="0.7", top_k="5", ignore_eos="true", seed="11",
        skip_special_tokens="false", stop_token_ids=["3"], logprobs="2"), return_logprobs=True)
    s = parsed.sampling
    assert (parsed.max_tokens, s.min_tokens, s.temperature, s.top_k, s.ignore_eos, s.seed) == (128, 4, 0.7, 5, True, 11)
    assert (s.skip_special_tokens, s.stop_token_ids, parsed.outputs.top_logprobs, s.logprobs) == (False, (3,), 2, 2)


@pytest.mark.parametrize("key, value, match", [
    ("max_tokens", "lots", "sampling_parameters.max_tokens must be an integer, got 'lots'"),
    ("temperature", "warm", "sampling_parameters.temperature must be a number"),
    ("ignore_eos", "yes", "sampling_parameters.ignore_eos must be a boolean"),
    ("ignore_eos", 1, "sampling_parameters.ignore_eos must be a boolean"),
    ("top_k", True, "sampling_parameters.top_k must be an integer"),
    ("stop", 5, "sampling_parameters.stop must be a list of strings"),
    ("stop", ["a", 1], "sampling_parameters.stop must be a list of strings"),
    ("bad_words", "x", "sampling_parameters.bad_words must be a list of strings"),
    ("stop_token_ids", ["x"], r"sampling_parameters.stop_token_ids\[0\] must be an integer"),
    ("temperature", 10**400, "sampling_parameters.temperature must be a number"),
])
def test_SMP3_wrong_type_is_invalid_arg(key: str, value: Any, match: str):
    with pytest.raises(InvalidArgument, match=match):
        parse(text_input="a", sampling_parameters=json.dumps({key: value}))


# One type rule for every source ([SMP-3]): a JSON or request-parameter value is accepted exactly
# when the §2.2 tensor of that setting could carry it (top_k is INT32, seed UINT64, temperature FP32).
INT32_RANGE = r"must be an integer in \[-2\*\*31, 2\*\*31\) \(INT32\)"
UINT64_RANGE = r"must be an integer in \[0, 2\*\*64\) \(UINT64\)"
BAD_JSON_VALUES = [
    ("top_k", 1e20, rf"^sampling_parameters.top_k {INT32_RANGE}, got 1e\+20$"),
    ("top_k", 10**20, rf"sampling_parameters.top_k {INT32_RANGE}, got 100000000000000000000"),
    ("top_k", -2**31 - 1, rf"sampling_parameters.top_k {INT32_RANGE}"),
    ("top_k", "1e20", rf"sampling_parameters.top_k {INT32_RANGE}, got '1e20'"),
    ("top_k", 2.5, "^sampling_parameters.top_k must be an integer, got 2.5$"),
    ("top_k", "2.5", "sampling_parameters.top_k must be an integer, got '2.5'"),
    ("max_tokens", float("nan"), "sampling_parameters.max_tokens must be an integer, got nan"),
    ("max_tokens", float("inf"), "sampling_parameters.max_tokens must be an integer, got inf"),
    ("max_tokens", "nan", "sampling_parameters.max_tokens must be an integer, got 'nan'"),
    ("max_tokens", "1_000", "sampling_parameters.max_tokens must be an integer"),
    ("max_tokens", "0x10", "sampling_parameters.max_tokens must be an integer"),
    ("max_tokens", "\u0661\u0662", "sampling_parameters.max_tokens must be an integer"),  # Arabic-Indic 12
    ("max_tokens", "", "sampling_parameters.max_tokens must be an integer"),
    ("min_tokens", True, "sampling_parameters.min_tokens must be an integer, got True"),
    ("min_tokens", "true", "sampling_parameters.min_tokens must be an integer"),
    ("logprobs", 2.5, "sampling_parameters.logprobs must be an integer"),
    ("n", 1e20, rf"sampling_parameters.n {INT32_RANGE}"),  # a type error, not UNSUPPORTED
    ("seed", 2**64, rf"sampling_parameters.seed {UINT64_RANGE}, got 18446744073709551616"),
    ("seed", -1, rf"sampling_parameters.seed {UINT64_RANGE}, got -1"),
    ("seed", 1e19, r"sampling_parameters.seed must be an integer, got 1e\+19: a float above 2\*\*53 is not exact"),
    ("stop_token_ids", [1, 1e20], rf"sampling_parameters.stop_token_ids\[1\] {INT32_RANGE}"),
    ("temperature", True, "sampling_parameters.temperature must be a number, got True"),
    ("temperature", "inf", "sampling_parameters.temperature must be a number, got 'inf'"),
    ("temperature", "NaN", "sampling_parameters.temperature must be a number"),
    ("temperature", 1e300, r"sampling_parameters.temperature must be a number within ±3.402823e\+38 \(FP32\)"),
    ("temperature", 10**400, "sampling_parameters.temperature must be a number within"),
    ("top_p", float("nan"), r"top_p must be in \(0, 1\], got nan"),  # NaN is FP32; the range refuses it
    ("temperature", float("inf"), "temperature must be finite and >= 0, got inf"),
    ("ignore_eos", 0.0, r"sampling_parameters.ignore_eos must be a boolean \(true or false\), got 0.0"),
    ("ignore_eos", "1", "sampling_parameters.ignore_eos must be a boolean"),
    ("detokenize", 0, "sampling_parameters.detokenize must be a boolean"),
]


@pytest.mark.parametrize("key, value, match", BAD_JSON_VALUES,
                         ids=[f"{k}={str(v)[:12]}" for k, v, _ in BAD_JSON_VALUES])
def test_SMP3_value_the_tensor_type_cannot_carry_is_invalid_arg(key: str, value: Any, match: str):
    with pytest.raises(InvalidArgument, match=match):
        parse(text_input="a", sampling_parameters=json.dumps({key: value}))


def test_SMP3_request_parameters_follow_the_same_type_rule():
    with pytest.raises(InvalidArgument, match=rf"^request parameter 'top_k' {INT32_RANGE}, got 1e\+20$"):
        parse({"top_k": 1e20}, text_input="a")
    with pytest.raises(InvalidArgument, match=r"request parameter 'ignore_eos' must be a boolean \(true or false\), got 1"):
        parse({"ignore_eos": 1}, text_input="a")
    assert parse({"top_k": "7", "seed": 2**64 - 1}, text_input="a").sampling.seed == 2**64 - 1


GOOD_JSON_VALUES = [
    ("max_tokens", 128.0, 128), ("max_tokens", "128", 128), ("max_tokens", "128.0", 128),
    ("max_tokens", "1e2", 100), ("max_tokens", " 7 ", 7), ("top_k", 2**31 - 1, 0),  # above the vocab: off
    ("top_k", "-1", 0), ("seed", 2**64 - 1, 2**64 - 1), ("seed", "18446744073709551615", 2**64 - 1),
    ("seed", 2.0**53, 2**53), ("temperature", 1, 1.0), ("temperature", "0.7", 0.7),
    ("temperature", "-0", 0.0), ("ignore_eos", "TRUE", True), ("ignore_eos", " false", False),
]


@pytest.mark.parametrize("key, value, expected", GOOD_JSON_VALUES,
                         ids=[f"{k}={str(v)[:12]}" for k, v, _ in GOOD_JSON_VALUES])
def test_SMP3_values_the_tensor_type_carries_are_accepted(key: str, value: Any, expected: Any):
    parsed = parse(text_input="a", sampling_parameters=json.dumps({key: value}))
    got = parsed.max_tokens if key == "max_tokens" else getattr(parsed.sampling, key)
    assert got == expected and type(got) is type(expected)


# Tensors of another dtype than declared (only in-process callers can send them: Triton checks the
# declared dtype): the kind must fit, and the value must fit the declared type as a JSON value must.
BAD_TENSORS = [
    ({"top_k": np.array([2**40], dtype=np.int64)}, rf"^top_k {INT32_RANGE}, got 1099511627776$"),
    ({"max_tokens": np.array([2**63], dtype=np.uint64)}, rf"^max_tokens {INT32_RANGE}"),
    ({"seed": np.array([-1], dtype=np.int64)}, rf"^seed {UINT64_RANGE}, got -1$"),
    ({"random_seed": np.array([-5], dtype=np.int8)}, rf"^random_seed {UINT64_RANGE}, got -5$"),
    ({"stop_token_ids": np.array([1, 2**40], dtype=np.int64)}, rf"^stop_token_ids\[1\] {INT32_RANGE}"),
    ({"temperature": np.array([1e300], dtype=np.float64)}, r"^temperature must be a number within ±3.402823e\+38"),
    ({"temperature": np.array([1], dtype=np.int32)}, "^temperature: expected FP32, got int32$"),
    ({"top_k": np.array([5.0], dtype=np.float32)}, "^top_k: expected INT32, got float32$"),
    ({"max_tokens": np.array([True])}, "^max_tokens: expected INT32, got bool$"),
    ({"seed": np.array([1.0])}, "^seed: expected UINT64, got float64$"),
    ({"ignore_eos": np.array([1], dtype=np.int32)}, "^ignore_eos: expected BOOL, got int32$"),
    ({"stop_token_ids": np.array([1.0, 2.0])}, "^stop_token_ids: expected INT32, got float64$"),
    ({"temperature": torch.tensor([0.5], dtype=torch.bfloat16)}, "^temperature: unexpected tensor dtype torch.bfloat16$"),
]


@pytest.mark.parametrize("inputs, match", BAD_TENSORS, ids=[
    f"{k}-{v.dtype}" for inputs, _ in BAD_TENSORS for k, v in inputs.items()])
def test_tensor_of_another_dtype_follows_the_declared_type(inputs: dict[str, Any], match: str):
    with pytest.raises(InvalidArgument, match=match):
        parse(text_input="a", **inputs)


def test_wider_tensor_dtypes_with_values_in_range_are_accepted():
    s = parse(text_input="a", top_k=np.array([7], dtype=np.int64), seed=np.array([2**64 - 1], dtype=np.uint64),
              temperature=np.array([0.25], dtype=np.float64), stop_token_ids=np.array([3], dtype=np.int64)).sampling
    assert (s.top_k, s.seed, s.temperature, s.stop_token_ids) == (7, 2**64 - 1, 0.25, (3,))


def test_SMP3_stop_string_or_list():
    assert parse(text_input="a", sampling_parameters=sp(stop="\n")).sampling.stop == ("\n",)
    assert parse(text_input="a", sampling_parameters=sp(stop=["a", "b"])).sampling.stop == ("a", "b")


@pytest.mark.parametrize("key, value, error", [
    ("n", 1, None), ("n", None, None), ("n", 2, Unsupported), ("n", "2", Unsupported),
    ("best_of", 1, None), ("best_of", 3, Unsupported),
    ("detokenize", True, None), ("detokenize", False, Unsupported), ("detokenize", "false", Unsupported),
    ("spaces_between_special_tokens", False, None), ("include_stop_str_in_output", True, None),
])
def test_SMP3_compatibility_keys(key: str, value: Any, error: type[Exception] | None):
    text = json.dumps({key: value})
    if error is None:
        parse(text_input="a", sampling_parameters=text)
    else:
        with pytest.raises(error, match=key):
            parse(text_input="a", sampling_parameters=text)


def test_SMP3_include_stop_str_and_skip_special_tokens():
    s = parse(text_input="a", sampling_parameters=sp(include_stop_str_in_output=True, skip_special_tokens=False)).sampling
    assert s.include_stop_str_in_output and not s.skip_special_tokens


def test_SMP3_logprobs_sets_top_logprobs_and_tensor_wins():
    assert parse(text_input="a", sampling_parameters=sp(logprobs=5)).outputs.top_logprobs == 5
    assert parse(text_input="a", top_logprobs=2, sampling_parameters=sp(logprobs=5)).outputs.top_logprobs == 2
    with pytest.raises(InvalidArgument, match=r"sampling_parameters.logprobs must be in \[0, 20\], got 21"):
        parse(text_input="a", sampling_parameters=sp(logprobs=21))


def test_SMP3_size_limit():
    with pytest.raises(InvalidArgument, match="sampling_parameters is .* bytes; at most 65536"):
        parse(text_input="a", sampling_parameters=sp(stop=["x" * 200] * 400))


def test_SMP3_hostile_json_is_invalid_arg_not_internal():
    with pytest.raises(InvalidArgument, match="sampling_parameters is not valid JSON"):
        parse(text_input="a", sampling_parameters="[" * 60000)
    with pytest.raises(InvalidArgument, match="sampling_parameters is not valid JSON"):
        parse(text_input="a", sampling_parameters='{"seed": ' + "9" * 5000 + "}")


# ---- ranges (§2.2) -------------------------------------------------------------------------------


def _case_id(inputs: dict[str, Any]) -> str:
    return ",".join(f"{k}={str(v)[:16]}" for k, v in inputs.items())


RANGE_CASES = [
    ({"top_p": 1.5}, InvalidArgument, r"^top_p must be in \(0, 1\], got 1.5$"),
    ({"top_p": 0.0}, InvalidArgument, r"top_p must be in \(0, 1\], got 0.0"),
    ({"temperature": -1.0}, InvalidArgument, "temperature must be finite and >= 0"),
    ({"temperature": float("nan")}, InvalidArgument, "temperature must be finite and >= 0"),
    ({"top_k": -2}, InvalidArgument, "top_k must be -1, 0 or >= 1"),
    ({"min_p": 1.5}, InvalidArgument, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, InvalidArgument, "repetition_penalty must be finite and > 0"),
    ({"presence_penalty": 2.5}, InvalidArgument, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3.0}, InvalidArgument, r"frequency_penalty must be in \[-2, 2\]"),
    ({"length_penalty": float("inf")}, InvalidArgument, "length_penalty must be finite"),
    ({"max_tokens": 0}, InvalidArgument, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 5, "min_tokens": 6}, InvalidArgument, r"min_tokens must be in \[0, max_tokens=5\], got 6"),
    ({"min_tokens": -1}, InvalidArgument, "min_tokens must be in"),
    ({"top_logprobs": 21}, InvalidArgument, r"top_logprobs must be in \[0, 20\], got 21"),
    ({"top_logprobs": -1}, InvalidArgument, r"top_logprobs must be in \[0, 20\]"),
    ({"end_id": VOCAB}, InvalidArgument, rf"end_id must be in \[0, {VOCAB}\), got {VOCAB}"),
    ({"pad_id": -1}, InvalidArgument, r"pad_id must be in \[0, 512\), got -1"),
    ({"stop_token_ids": [1, VOCAB]}, InvalidArgument, r"stop_token_ids\[1\] must be in \[0, 512\)"),
    ({"stop_token_ids": list(range(65))}, InvalidArgument, "stop_token_ids: at most 64 ids allowed, got 65"),
    ({"stop_words": ["s"] * 33}, InvalidArgument, "stop_words: at most 32 strings allowed, got 33"),
    ({"stop_words": ["ok", ""]}, InvalidArgument, r"stop_words\[1\] must be 1 to 256 bytes, got 0"),
    ({"stop_words": ["é" * 129]}, InvalidArgument, r"stop_words\[0\] must be 1 to 256 bytes, got 258"),
    ({"stop_words": [b"\xc3"]}, InvalidArgument, r"stop_words\[0\] is not valid UTF-8 at byte 0"),
    ({"bad_words": ["b"] * 257}, InvalidArgument, "bad_words: at most 256 strings allowed, got 257"),
    ({"bad_words": ["x" * 257]}, InvalidArgument, r"bad_words\[0\] must be 1 to 256 bytes, got 257"),
    ({"sampling_parameters": sp(stop=[""])}, InvalidArgument, r"sampling_parameters.stop\[0\] must be 1 to 256"),
    ({"beam_width": 2}, Unsupported, "^beam_width > 1 is not supported$"),
    ({"beam_width": 0}, InvalidArgument, "beam_width must be 1, got 0"),
    ({"num_return_sequences": 4}, Unsupported, "num_return_sequences > 1 is not supported"),
    ({"num_return_sequences": -1}, InvalidArgument, "num_return_sequences must be 1"),
    ({"return_context_logits": True}, Unsupported, "return_context_logits is not supported"),
    ({"return_generation_logits": True}, Unsupported, "return_generation_logits is not supported"),
    ({"guided_decoding_guide_type": "json"}, Unsupported, "guided decoding is not supported"),
    ({"guided_decoding_guide": "{}"}, Unsupported, "guided decoding is not supported"),
]


@pytest.mark.parametrize("inputs, error, match", RANGE_CASES, ids=[_case_id(c[0]) for c in RANGE_CASES])
def test_section_2_2_ranges(inputs: dict[str, Any], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        parse(text_input="a", **inputs)


def test_section_2_2_accepted_edge_values():
    s = parse(text_input="a", top_p=1.0, temperature=0.0, min_p=1.0, presence_penalty=-2.0, end_id=VOCAB - 1,
              pad_id=0, beam_width=1, num_return_sequences=1, return_context_logits=False,
              return_generation_logits=False, guided_decoding_guide_type="", guided_decoding_guide="",
              stop_words=["x" * 256], top_logprobs=20, prompt_table_extra_id=7, length_penalty=0.5).sampling
    assert s.end_id == VOCAB - 1 and s.greedy


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_SMP7_any_uint64_seed(seed: int):
    assert parse(text_input="a", seed=seed).sampling.seed == seed


@pytest.mark.parametrize("top_k, effective", [(-1, 0), (0, 0), (1, 1), (VOCAB, VOCAB), (VOCAB + 1, 0)])
def test_top_k_off_values_normalised(top_k: int, effective: int):
    assert parse(text_input="a", top_k=top_k).sampling.top_k == effective


# ---- outputs and log-probabilities ([LP-4]) ------------------------------------------------------


def test_output_flags_and_exclude_input_default():
    out = parse(text_input="a", stream=True, return_finish_reason=True, return_perf_metrics=True).outputs
    assert out.stream and out.return_finish_reason and out.return_perf_metrics and out.exclude_input_in_output
    assert not out.return_num_input_tokens and not out.needs_logprobs
    echo = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, exclude_input_in_output=False)
    assert not parse(defaults=echo, text_input="a").outputs.exclude_input_in_output
    assert parse(defaults=echo, text_input="a", exclude_input_in_output=True).outputs.exclude_input_in_output


@pytest.mark.parametrize("flags, logprobs", [
    ({}, None), ({"top_logprobs": 3}, None), ({"return_log_probs": True, "top_logprobs": 3}, 0),
    ({"return_cumulative_logprob": True}, 0), ({"return_logprobs": True, "top_logprobs": 3}, 3),
])
def test_LP4_logprobs_only_when_an_output_needs_them(flags: dict[str, Any], logprobs: int | None):
    assert parse(text_input="a", **flags).sampling.logprobs == logprobs


# ---- images (§4.2, [VIS-2], [IMG-1]..[IMG-3]) ----------------------------------------------------


def test_IMG3_text_placeholder_expanded(tok: Tokenizer):
    parsed = parse(text_input=f"a{IMAGE_PLACEHOLDER_TEXT}b", **images((4,)))
    request, echo = build(tok, parsed)
    block = tok.image_block((56, 224), 4)  # image_sizes (W0, H0) = (28·2, 28·8)
    assert request.prompt_ids == [ord("a"), *block, ord("b")]
    assert echo == f"a{IMAGE_PLACEHOLDER_TEXT}b"
    assert request.image_embeds.shape == (4, HIDDEN) and parsed.images.hashes == ("0" * 32,)


def test_IMG1_messages_image_parts_are_placeholders(tok: Tokenizer):
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
               {"type": "image_url", "image_url": "data:image/png;base64,AA=="},
               {"type": "image"}, {"type": "image", "image": "AA=="}, {"type": "text", "text": "what?"}]
    parsed = parse(text_input="", messages=user(content), **images((1, 2, 3, 4)))
    request, echo = build(tok, parsed)
    assert echo.count("<|media_pad|>") == 4  # unexpanded in the echo ([TXT-4])
    assert request.prompt_ids.count(tok.media_pad_id) == 10
    assert request.prompt_ids.count(tok.id_of("<|media_begin|>")) == 4


def test_IMG2_messages_images_without_embeddings():
    with pytest.raises(InvalidArgument, match="^images need k3_ensemble or precomputed image_embeds$"):
        parse(text_input="", messages=user([{"type": "image_url", "image_url": "http://x/y.png"}]))


def test_IMG2_placeholder_count_mismatch(tok: Tokenizer):
    text = f"{IMAGE_PLACEHOLDER_TEXT} and <|media_pad|>"
    with pytest.raises(InvalidArgument, match="^the prompt has 2 image placeholders but 1 image was supplied$"):
        build(tok, parse(text_input=text, **images((4,))))
    with pytest.raises(InvalidArgument, match="the prompt has 1 image placeholder but 0 images were supplied"):
        build(tok, parse(text_input=IMAGE_PLACEHOLDER_TEXT))
    with pytest.raises(InvalidArgument, match="the prompt has 0 image placeholders but 1 image was supplied"):
        build(tok, parse(text_input="no placeholder", **images((4,))))


def test_IMG1_framing_block_is_one_placeholder(tok: Tokenizer):
    text = "<|media_begin|>image 9x9<|media_content|><|media_pad|><|media_end|>!"
    request, _ = build(tok, parse(text_input=text, **images((4,))))
    assert request.prompt_ids == [*tok.image_block((56, 224), 4), ord("!")]


@pytest.mark.parametrize("overrides, match", [
    ({"image_embeds": np.zeros((5, HIDDEN), np.float32)},
     "^image_embeds has 5 rows but image_token_counts sums to 4$"),
    ({"image_embeds": np.zeros((4, HIDDEN + 1), np.float32)}, r"expected shape \[rows, 8\] \(the LM hidden size\)"),
    ({"image_embeds": np.zeros((4, HIDDEN), np.int32)}, "image_embeds: expected BF16 or FP32"),
    ({"image_token_counts": [4, 4]}, "image_grid_thw has 1 entries but image_token_counts has 2"),
    ({"image_grid_thw": np.array([(1, 4, 8)], np.int64)}, r"image 0: image_token_counts 4 does not match image_grid_thw"),
    ({"image_grid_thw": np.array([(2, 4, 2)], np.int64)}, "expected t = 1"),
    ({"image_grid_thw": np.array([(1, 4)], np.int64)}, r"image_grid_thw: expected shape \[n_images, 3\]"),
    ({"image_sizes": np.array([(0, 5)], np.int32)}, "image_sizes must be positive"),
    ({"image_hashes": ["ABCDEF" * 5 + "AB"]}, "image_hashes must be 32 lowercase hex characters"),
    ({"image_hashes": ["a" * 31]}, "image_hashes must be 32 lowercase hex characters"),
    ({"image_hashes": ["0" * 32, "1" * 32]}, "image_hashes has 2 entries but image_token_counts has 1"),
], ids=["rows", "hidden", "dtype", "counts-len", "count-vs-grid", "t", "grid-shape", "size", "hash-case",
        "hash-len", "hash-count"])
def test_VIS2_precomputed_embeddings_invariants(overrides: dict[str, Any], match: str):
    with pytest.raises(InvalidArgument, match=match):
        parse(text_input=IMAGE_PLACEHOLDER_TEXT, **images((4,), **overrides))


def test_VIS2_image_inputs_come_together():
    partial = images((4,))
    del partial["image_hashes"], partial["image_sizes"]
    with pytest.raises(InvalidArgument, match="image inputs come together: .* but not image_sizes, image_hashes"):
        parse(text_input=IMAGE_PLACEHOLDER_TEXT, **partial)


def test_section_4_2_bf16_embeddings_as_torch_tensor(tok: Tokenizer):
    embeds = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    parsed = parse(text_input=IMAGE_PLACEHOLDER_TEXT * 2, **images((2, 4), image_embeds=embeds))
    request, _ = build(tok, parsed)
    assert request.image_embeds.dtype == torch.bfloat16 and torch.equal(request.image_embeds, embeds)
    assert parsed.images.n_images == 2 and parsed.images.sizes == ((56, 112), (56, 224))


# ---- SMP-5, STP-6 and the engine Request ---------------------------------------------------------


def test_SMP5_absent_max_tokens_is_clipped_to_context(tok: Tokenizer):
    assert build(tok, parse(text_input="abcd"), max_model_len=100)[0].params.max_tokens == 16
    assert build(tok, parse(text_input="abcd"), max_model_len=10)[0].params.max_tokens == 6
    assert build(tok, parse(text_input="abcd"), default_max_tokens=3)[0].params.max_tokens == 3


def test_SMP5_explicit_max_tokens_is_kept_for_the_engine_to_check(tok: Tokenizer):
    """Only the engine checks prompt + max_tokens against max_model_len (test_engine: one place)."""
    assert build(tok, parse(text_input="abcd", max_tokens=7), max_model_len=10)[0].params.max_tokens == 7
    assert build(tok, parse(text_input="abcd"), max_model_len=4)[0].params.max_tokens == 1


def test_SMP5_min_tokens_checked_against_resolved_max_tokens(tok: Tokenizer):
    with pytest.raises(InvalidArgument, match=r"min_tokens must be in \[0, max_tokens=6\], got 8"):
        build(tok, parse(text_input="abcd", min_tokens=8), max_model_len=10)


def test_STP6_bad_words_as_given_and_with_a_leading_space(tok: Tokenizer):
    request, _ = build(tok, parse(text_input="a", bad_words=["ab", "<|open|>"]))
    space = ord(" ")
    expected = {(97, 98), (space, 97, 98), tuple(b"<|open|>"), (space, *b"<|open|>")}
    assert set(request.bad_word_seqs) == expected and len(request.bad_word_seqs) == 4
    assert bad_word_sequences(["x", "x"], tok) == ((120,), (space, 120))


def test_request_carries_ids_params_and_arrival(tok: Tokenizer):
    parsed = parse(request_id="abc", text_input="hi", max_tokens=5, temperature=0.0, seed=3, ignore_eos=True,
                   end_id=7, stop_words=["x"], stop_token_ids=[9])
    request, _ = build(tok, parsed)
    assert (request.request_id, request.eos_ids, request.arrival_time) == ("abc", EOS, parsed.arrival_time)
    p = request.params
    assert (p.max_tokens, p.greedy, p.seed, p.ignore_eos, p.end_id, p.stop, p.stop_token_ids) == (
        5, True, 3, True, 7, ("x",), (9,))


def test_build_request_refuses_a_stop_request(tok: Tokenizer):
    with pytest.raises(ValueError, match="stop request"):
        build(tok, parse(request_id="x", text_input="", stop=True))


# ---- generation_config.json ([SMP-1] level 4, [CFG-L4]) ------------------------------------------


def test_load_generation_defaults(tmp_path):
    assert load_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5, "do_sample": True,
         "eos_token_id": [1], "min_p": None}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    defaults = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, **load_generation_defaults(tmp_path))
    assert parse(defaults=defaults, text_input="a").sampling.top_k == 20


@pytest.mark.parametrize("config, match", [
    ({"top_p": 2.0}, r"top_p must be in \(0, 1\]"), ({"temperature": "hot"}, "temperature must be a number"),
    ({"temperature": "0.7"}, "temperature must be a number, got '0.7'"),  # no quoted numbers in a file
    ({"top_k": 40.5}, "top_k must be an integer, got 40.5"), ({"top_k": 1e20}, r"top_k must be an integer in"),
    ({"top_p": True}, "top_p must be a number, got True"),
], ids=["top_p-range", "temperature-word", "temperature-quoted", "top_k-fraction", "top_k-huge", "top_p-bool"])
def test_load_generation_defaults_rejects_bad_values(tmp_path, config: dict, match: str):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_generation_defaults(tmp_path)


def test_image_inputs_on_a_text_only_checkpoint_are_invalid_arg():
    """k3_lm called directly with image rows, on a checkpoint without a vision tower."""
    text_only = LmDefaults(vocab_size=VOCAB, hidden_size=HIDDEN, has_vision=False, model_type="kimi_linear")
    with pytest.raises(InvalidArgument, match=r"this checkpoint has no vision tower \(model_type kimi_linear\): "
                                              "it serves text only"):
        parse(defaults=text_only, text_input=IMAGE_PLACEHOLDER_TEXT, **images())
    assert parse(defaults=text_only, text_input="hi").images is None
