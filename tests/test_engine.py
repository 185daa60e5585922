"""The engine core: batched, chunked generation equals the single-request loop; ids, termination,
cancellation, admission checks and failure (in process, one thread: `EngineCore.step()`).

Spec: SERVING.md §5.4–5.5, §5.10, §6, ENGINE.md §2. Reference outputs come from
`k3backend.generate.generate`. Batching and chunked prefill change fp32 logits in the last bits
(GEMMs of another shape, chunked vs recurrent KDA), so the tests that compare such runs token for
token use a float64 model. Text (detokenization, stop strings) is the serving layer's:
tests/test_stream.py.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace

import pytest
import torch

from k3backend.checkpoint import load_model
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore
from k3backend.engine.request import FinishReason, Request, TokenLogprob
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams
from k3backend.generate import generate
from k3backend.presets import make_checkpoint
from k3backend.tokenizer import Tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops on a 2-core box are ~20x slower with several torch threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_engine"))


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def model32(ckpt):
    return load_model(ckpt, progress=False)


@pytest.fixture(scope="module")
def model64(ckpt):
    return load_model(ckpt, dtype=torch.float64, progress=False)


def new_core(model, **cfg) -> EngineCore:
    c = EngineConfig(**{"max_model_len": 1024, "cpu_cache_gb": 0.25, **cfg})
    return EngineCore(InProcessExecutor(model, c), c)


@dataclass
class Completion:
    """What one request got from the engine: its ids, log-probs, how it ended, cached prompt tokens."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason = FinishReason.NONE
    error: tuple[str, str] | None = None
    num_cached_tokens: int = 0
    steps: int = 0  # engine steps it took part in


_IDS = itertools.count(1)  # ids stay unique across runs on one engine


def run(core: EngineCore, requests: list[Request], hook=None) -> dict[str, Completion]:
    """Add every request, step until all ended; `hook(step, core, rids)` runs before each step."""
    rids = {next(_IDS): r.request_id for r in requests}
    for rid, r in zip(rids, requests):
        core.add(rid, r)
    got = {name: Completion() for name in rids.values()}
    live, step = set(rids), 0
    while live:
        if hook is not None:
            hook(step, core, {v: k for k, v in rids.items()})
        out = core.step()
        step += 1
        for rid, cached in zip(out.started.tolist(), out.cached.tolist()):
            got[rids[rid]].num_cached_tokens = cached
        for rid, token, finish in zip(out.ids.tolist(), out.tokens.tolist(), out.finish.tolist()):
            c = got[rids[rid]]
            assert rid in live, f"{rids[rid]}: news after its end ({'ended again' if finish else f'token {token}'})"
            c.steps += 1
            if token >= 0:
                c.token_ids.append(token)
            if rid in out.logprobs:
                c.logprobs.append(out.logprobs[rid])
            if finish:
                c.finish, c.error = FinishReason(finish), out.errors.get(rid)
                live.discard(rid)
        assert step < 10_000, "the engine does not finish"
    return got


def reference(model, req: Request) -> list[int]:
    return [s.token for s in generate(model, req.prompt_ids, req.params, eos_ids=req.eos_ids,
                                      image_embeds=req.image_embeds, bad_word_seqs=req.bad_word_seqs)]


def assert_idle(core: EngineCore) -> None:
    s = core.stats()
    assert (s.num_running, s.num_waiting, s.kv_cache_usage, s.state_slots_usage) == (0, 0, 0.0, 0.0)
    assert not core.has_work


def prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, allow_special=True)


# ---- same tokens as the single-request loop ----------------------------------------------------

CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
    "seeded": SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, repetition_penalty=1.1,
                             frequency_penalty=0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_single_request_equals_generate(model32, tok, case):
    params = CASES[case]
    req = Request("r", prompt(tok, "The quick brown fox jumps over"), params, eos_ids=(tok.eos_id,))
    core = new_core(model32)
    out = run(core, [req])["r"]
    ref = list(generate(model32, req.prompt_ids, params, eos_ids=req.eos_ids))
    assert out.token_ids == [s.token for s in ref]
    eos = out.token_ids[-1] == tok.eos_id
    assert out.finish is (FinishReason.STOP if eos else FinishReason.LENGTH)
    if params.logprobs is not None:
        assert [lp.logprob for lp in out.logprobs] == [s.logprob for s in ref]
        assert [lp.token for lp in out.logprobs] == out.token_ids
        assert all(lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == lp.token for lp in out.logprobs)
    else:
        assert out.logprobs == []
    assert_idle(core)


def test_concurrent_requests_equal_their_run_alone_tokens(model64, tok):
    """8 requests, at most 4 running: admissions happen while others decode. float64: see the module doc."""
    reqs = [Request(f"r{i}", prompt(tok, f"request {i}: " + "abcdefgh"[:i + 1] * (i + 1)),
                    SamplingParams(max_tokens=6 + i % 3, temperature=0.0 if i % 2 else 1.0, seed=100 + i,
                                   logprobs=1 if i == 3 else None))
            for i in range(8)]
    outs = run(new_core(model64, max_num_seqs=4), reqs)
    for r in reqs:
        assert outs[r.request_id].token_ids == reference(model64, r), r.request_id


def test_chunked_prefill_equals_generate(model64, tok):
    """A 7-token budget splits both prompts into chunks, and two sequences share prefill steps."""
    reqs = [Request(f"r{i}", prompt(tok, text), SamplingParams(max_tokens=5, temperature=0.7, seed=i))
            for i, text in enumerate(["a prompt that is much longer than seven tokens", "and a second one"])]
    core = new_core(model64, max_num_batched_tokens=7)
    outs = run(core, reqs)
    for r in reqs:
        assert outs[r.request_id].token_ids == reference(model64, r)
    assert core.stats().steps > len(reqs[0].prompt_ids) // 7


@pytest.mark.parametrize("chunk", [None, 3], ids=["one-prefill", "chunked"])
def test_image_embeddings_replace_media_pads(model64, tok, chunk):
    pad = tok.media_pad_id
    ids = prompt(tok, "look:") + [pad] * 4 + prompt(tok, " and ") + [pad] * 3 + prompt(tok, "?")
    embeds = torch.randn(7, model64.cfg.text.hidden_size, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64)
    req = Request("img", ids, SamplingParams(max_tokens=6, temperature=0.0), image_embeds=embeds)
    core = new_core(model64, **({} if chunk is None else {"max_num_batched_tokens": chunk}))
    assert run(core, [req])["img"].token_ids == reference(model64, req)
    assert reference(model64, req) != reference(model64, replace(req, image_embeds=embeds * 2))


# ---- termination by id ([STP-1] checks 1 and 3) ---------------------------------------------------

@pytest.fixture(scope="module")
def greedy_ref(model32, tok):
    """A greedy request and its 24 reference tokens (EOS ignored)."""
    req = Request("g", prompt(tok, "Once upon a time"),
                  SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), eos_ids=(tok.eos_id,))
    return req, reference(model32, req)


@pytest.mark.parametrize("how", ["end_id", "stop_token_ids", "eos_ids"])
def test_stop_token_ends_with_stop(model32, tok, greedy_ref, how):
    req, ref = greedy_ref
    target = ref[2]
    params = replace(req.params, ignore_eos=False, end_id=target if how == "end_id" else None,
                     stop_token_ids=(target,) if how == "stop_token_ids" else ())
    stopping = replace(req, params=params, eos_ids=(target,) if how == "eos_ids" else (tok.eos_id,))
    expected = reference(model32, stopping)
    assert expected[-1] == target and len(expected) <= 3
    # ignore_eos + min_tokens = max_tokens: exactly max_tokens tokens, the stop ids masked ([STP-4], [STP-5])
    exact = replace(stopping, request_id="x", params=replace(params, ignore_eos=True, min_tokens=params.max_tokens))
    outs = run(new_core(model32), [stopping, exact])
    assert outs["g"].finish is FinishReason.STOP and outs["g"].token_ids == expected
    assert outs["x"].finish is FinishReason.LENGTH
    assert len(outs["x"].token_ids) == params.max_tokens and target not in outs["x"].token_ids


# ---- cancellation ------------------------------------------------------------------------------

def long_request(req: Request, request_id: str = "g") -> Request:
    return replace(req, request_id=request_id, params=replace(req.params, max_tokens=200))


def test_abort_ends_a_running_and_a_queued_request_cancelled(model32, greedy_ref):
    """max_num_seqs=1: one request runs, the other waits; an abort of each ends it CANCELLED at the
    next step boundary, with no token after it, and frees everything."""
    req, ref = greedy_ref
    core = new_core(model32, max_num_seqs=1)

    def hook(step, core, rids):
        if step == 5:
            core.abort(rids["a"])
            core.abort(rids["b"])
            core.abort(10**9)  # unknown ids are ignored

    outs = run(core, [long_request(req, "a"), long_request(req, "b")], hook)
    assert outs["a"].finish is outs["b"].finish is FinishReason.CANCELLED
    assert outs["a"].token_ids == ref[:len(outs["a"].token_ids)] and 0 < len(outs["a"].token_ids) < 8
    assert outs["b"].token_ids == [] and outs["b"].steps == 1
    assert_idle(core)


# ---- admission checks, failure ------------------------------------------------------------------

def test_invalid_requests_end_with_invalid_arg_in_the_next_step(model32, tok):
    """The engine's own checks: the request ends in the next step's outputs, ERROR with the message."""
    core = new_core(model32)
    ok = SamplingParams(max_tokens=4)
    cases = {
        "long": (Request("long", [65] * 1000, SamplingParams(max_tokens=100)),
                 r"^prompt \(1000 tokens\) \+ max_tokens \(100\) exceeds max_model_len 1024$"),
        "no_room": (Request("no_room", [65] * 1024, SamplingParams(max_tokens=1)),
                    r"^prompt \(1024 tokens\) leaves no room for output within max_model_len 1024$"),
        "empty": (Request("empty", [], ok), "prompt is empty"),
        "vocab": (Request("vocab", [65, 512], ok), "token id 512 is outside the vocabulary 0..511"),
        "pads": (Request("pads", [tok.media_pad_id] * 2, ok, image_embeds=torch.zeros(1, 64)),
                 "2 image pad positions but image_embeds has 1 rows"),
        "rows": (Request("rows", [tok.media_pad_id] * 2, ok, image_embeds=torch.zeros(2, 63)),
                 r"image_embeds: expected \[2, 64\], got \[2, 63\]"),
    }
    outs = run(core, [r for r, _ in cases.values()])
    for name, (_, message) in cases.items():
        out = outs[name]
        assert out.finish is FinishReason.ERROR and out.error[0] == "INVALID_ARG", name
        assert re.search(message, out.error[1]), (name, out.error)
        assert out.steps == 1 and out.token_ids == []
    assert core.stats().steps == 0
    assert_idle(core)


def test_a_model_error_raises_out_of_the_step(model32, greedy_ref, monkeypatch):
    """The core does not answer for a failed step: the process around it reports the failure once
    (tests/test_engine_process.py) and the serving layer ends every request."""
    req, _ = greedy_ref
    core = new_core(model32)
    lm, calls = model32.language_model, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected fault")
        return type(lm).forward(lm, *args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)
    with pytest.raises(RuntimeError, match="injected fault"):
        run(core, [long_request(req, "r0"), long_request(req, "r1")])
