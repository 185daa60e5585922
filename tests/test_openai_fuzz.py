"""Fuzz the OpenAI gateway on a real tritonserver: malformed and odd bodies, text-only ones (which go to
k3_lm directly) and ones with image parts (through k3_ensemble), streamed and whole, sent while valid
greedy streams run beside them.

Every request must end with an answer: 200 with a whole body or a stream ending in `[DONE]`, or a client
error (400/404/413) in OpenAI's error JSON. A 5xx is a defect here (the server is healthy throughout), as
is a valid stream whose text differs from its run alone, or a request left running afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import aiohttp

from k3client import metric, metrics, png_data_uri
from test_openai import KEY, LIMIT, gateway, server  # noqa: F401 - the same server and gateway fixtures

CASES = 160
SEED = 20261204
VALID = [{"model": "k3", "prompt": f"Valid stream {i}: the river", "max_tokens": 6, "temperature": 0,
          "ignore_eos": True, "stream": True} for i in range(4)]
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


# ---- bodies -------------------------------------------------------------------------------------

ODD = [None, True, -1, 0, 2**31, 2**64, 1e308, float("nan"), "", "x" * 300, [], {}, [None], {"a": [1]}, "\udcff"]


def _text_part(g: random.Random):
    return g.choice([{"type": "text", "text": "Tell me"}, {"type": "text", "text": g.choice(ODD)}, {"type": "text"},
                     {"type": g.choice(["txt", "", None, "audio"]), "text": "x"}, "bare string", 7])


def _image_part(g: random.Random):
    url = g.choice([png_data_uri(16, 16, seed=g.randrange(9)), "data:image/png;base64,AAAA", "data:,", "not a url",
                    "data:image/png;base64," + "A" * 5000, None, 3, "http://127.0.0.1:9/x.png"])
    return g.choice([{"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": url},
                     {"type": "image_url"}, {"type": "image_url", "image_url": {"url": url, "detail": g.choice(ODD)}}])


def _message(g: random.Random):
    role = g.choice(["user", "user", "system", "assistant", "developer", "tool", "", None, 5, "robot"])
    content = g.choice(["Hello there", "", None, g.choice(ODD), [_text_part(g) for _ in range(g.randrange(3))],
                        [_text_part(g), _image_part(g)], [_image_part(g)]])
    msg = {"role": role, "content": content}
    if g.random() < 0.15:
        msg[g.choice(["name", "tool_calls", "refusal", "extra"])] = g.choice(ODD)
    if g.random() < 0.1:
        del msg[g.choice(["role", "content"])]
    return msg if g.random() > 0.05 else g.choice(ODD)


SANE = {"max_tokens": lambda g: g.randrange(1, 4), "n": lambda g: g.randrange(1, 3), "temperature": lambda g: g.random(),
        "stop": lambda g: g.choice(["\n", ["a", "b"]]), "top_p": lambda g: g.uniform(0.1, 1), "top_k": lambda g: g.randrange(50),
        "min_p": lambda g: g.uniform(0, 0.2), "seed": lambda g: g.randrange(100), "ignore_eos": lambda g: True,
        "stream_options": lambda g: {"include_usage": g.random() < 0.5}, "min_tokens": lambda g: 1,
        "presence_penalty": lambda g: g.uniform(-1, 1), "frequency_penalty": lambda g: g.uniform(-1, 1)}
ODD_KEYS = ["logprobs", "top_logprobs", "repetition_penalty", "thinking", "chat_template_kwargs", "echo", "user",
            "unknown_field", "logit_bias", "response_format", "tools", "best_of", "suffix", "max_completion_tokens"]


def _perturb(b: dict, chat: bool, g: random.Random) -> None:
    """One change that a careless or hostile client might make."""
    kind = g.randrange(5)
    if kind == 0:
        b[g.choice(list(SANE) + ODD_KEYS)] = g.choice(ODD)
    elif kind == 1 and chat:
        b["messages"][g.randrange(len(b["messages"]))] = _message(g)
    elif kind == 1:
        b["prompt"] = g.choice([[], [1, 2, 3], None, "", {"p": 1}, ["a", 7]])
    elif kind == 2:
        b["model"] = g.choice(["other", None, 1, ""])
    elif kind == 3:
        b.pop(g.choice(list(b)))
    else:
        b["messages" if chat else "prompt"] = g.choice([[], None, "hi", [{}], 5])


def body(g: random.Random) -> tuple[str, bytes]:
    """(path, raw body) of one fuzz request: a valid body (text, or with an image part), then 0-2 changes."""
    chat = g.random() < 0.6
    b = {"model": "k3", "max_tokens": 3, "stream": g.choice([True, False])}
    for k in g.sample(list(SANE), g.randrange(4)):
        b[k] = SANE[k](g)
    if chat:
        content = "Tell me a story" if g.random() < 0.6 else [{"type": "text", "text": "Tell me"}]
        if g.random() < 0.3:  # a valid image: through the ensemble
            content = [{"type": "image_url", "image_url": {"url": png_data_uri(16, 16, seed=g.randrange(9))}},
                       {"type": "text", "text": "What is it?"}]
        b["messages"] = [{"role": "system", "content": "Be brief."}] * g.randrange(2) + [{"role": "user", "content": content}]
        if g.random() < 0.2:
            b["logprobs"], b["top_logprobs"] = True, g.randrange(3)
    else:
        b["prompt"] = g.choice(["Once upon", ["a", "b"], "é" * 40])
    for _ in range(g.choice([0, 0, 1, 1, 2])):
        _perturb(b, chat, g)
    raw = json.dumps(b, allow_nan=True, ensure_ascii=g.random() < 0.5).encode("utf-8", "surrogatepass")
    mutate = g.random()
    if mutate < 0.04:
        raw = raw[: g.randrange(len(raw))]  # cut JSON
    elif mutate < 0.07:
        raw = b"\xff\xfe" + raw  # not UTF-8
    elif mutate < 0.09:
        raw = b'{"model": "k3", "prompt": "' + b"p" * (LIMIT + 10) + b'"}'  # over --max-request-bytes
    elif mutate < 0.11:
        raw = json.dumps([b]).encode()  # not an object
    return "/v1/chat/completions" if chat else "/v1/completions", raw


# ---- sending ------------------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    async with session.post(url + path, data=raw, headers=HEADERS) as r:
        return r.status, await r.read()


def check_answer(status: int, data: bytes, raw: bytes) -> str | None:
    """None if the answer is well formed, else what is wrong with it."""
    what = f"status {status} for {raw[:300]!r}: {data[:400]!r}"
    if status == 200:
        if data.startswith(b"data: "):
            return None if data.rstrip().endswith(b"data: [DONE]") else f"stream without [DONE]: {what}"
        try:
            obj = json.loads(data)
        except ValueError:
            return f"200 that is not JSON: {what}"
        return None if obj.get("choices") else f"200 without choices: {what}"
    if status not in (400, 404, 413):
        return f"unexpected {what}"
    try:
        err = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return f"error that is not OpenAI's error JSON: {what}"
    return None if isinstance(err.get("message"), str) and err["message"] else f"error without message: {what}"


def stream_text(data: bytes) -> str:
    text = []
    for line in data.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += [c.get("text") or "" for c in json.loads(line[6:]).get("choices", [])]
    return "".join(text)


def test_fuzzed_bodies_all_get_an_answer_and_leave_valid_streams_exact(server, gateway):
    g = random.Random(SEED)
    cases = [body(g) for _ in range(CASES)]

    async def run() -> tuple[list, list, list]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            alone = [await send(s, gateway.url, "/v1/completions", json.dumps(v).encode()) for v in VALID]
            sem = asyncio.Semaphore(8)

            async def one(path: str, raw: bytes) -> tuple[int, bytes]:
                async with sem:
                    return await send(s, gateway.url, path, raw)

            async def valid_again() -> list:
                out = []
                for _ in range(3):  # valid streams while the fuzz runs
                    out += await asyncio.gather(*(send(s, gateway.url, "/v1/completions", json.dumps(v).encode())
                                                  for v in VALID))
                return out

            fuzzed, beside = await asyncio.gather(asyncio.gather(*(one(p, r) for p, r in cases)), valid_again())
            return alone, fuzzed, beside

    alone, fuzzed, beside = asyncio.run(run())
    problems = [p for (status, data), (_, raw) in zip(fuzzed, cases) if (p := check_answer(status, data, raw))]
    assert not problems, f"{len(problems)} of {CASES} answers were wrong:\n" + "\n".join(problems[:10])
    statuses = collections.Counter(s for s, _ in fuzzed)
    print(f"fuzzed answers by status: {dict(statuses)}")
    assert statuses[200] >= CASES // 5 and statuses[400] >= CASES // 5, statuses  # reached the model, and refusals
    assert all(s == 200 for s, _ in alone + beside)
    want = [stream_text(d) for _, d in alone]
    assert all(w for w in want)
    assert [stream_text(d) for _, d in beside] == want * 3
    deadline = time.monotonic() + 5
    while metric(metrics(server.metrics_url), "k3:num_requests_running", model="k3_lm") != 0:
        assert time.monotonic() < deadline, "requests still running after every answer arrived"
        time.sleep(0.05)
