"""Incremental detokenizer: UTF-8 safety (TXT-1, STR-5), markup (TXT-2), reasoning (TXT-3), stops (STP-3, STR-6)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from k3backend.detokenizer import Delta, IncrementalDetokenizer, detokenize_all
from k3backend.tokenizer import Tokenizer, write_tiny_tokenizer

OPEN, CLOSE, SEP, EOM, MEDIA_PAD = 259, 260, 261, 258, 277  # tiny vocabulary ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


def stream(tok: Tokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None, **opts) -> list[Delta]:
    """Push `ids` in chunks of the given sizes (default: one token at a time), then finish."""
    detok = IncrementalDetokenizer(tok, **opts)
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    deltas, pos = [], 0
    for size in sizes:
        deltas.append(detok.push(ids[pos:pos + size]))
        pos += size
    assert pos == len(ids)
    deltas.append(detok.finish())
    return deltas


def joined(deltas: list[Delta]) -> tuple[str, str, bool]:
    return "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas), any(d.stopped for d in deltas)


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, allow_special=True)


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.choice([1, 1, 2, 3, 7])))
        n -= sizes[-1]
    return sizes


# ---- UTF-8 safety ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["Hello, world!", "你好，世界。中文测试", "rocket \U0001f680 fire \U0001f525 é",
                                  "mixed 中 \U0001f468\u200d\U0001f469 x"], ids=["ascii", "chinese", "emoji", "mixed"])
def test_byte_tokens_never_split_a_character(tok: Tokenizer, text: str):
    deltas = stream(tok, tok.encode(text, allow_special=False))
    assert all("\ufffd" not in d.text for d in deltas)
    assert all(d.text.encode("utf-8").decode("utf-8") == d.text for d in deltas)
    assert joined(deltas) == (text, "", False)


def test_incomplete_character_is_held_then_released(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([b]).text for b in "中".encode()] == ["", "", "中"]


def test_incomplete_tail_at_finish_becomes_replacement(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok)
    assert detok.push([ord("a"), 0xF0, 0x9F]).text == "a"
    assert detok.finish().text == "\ufffd"


def test_bytes_that_can_never_complete_are_replaced_at_once(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok)
    assert detok.push([0xFF]).text == "\ufffd"
    assert detok.push([0xE4, ord("A")]).text == "\ufffdA"


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "raw"])
def test_random_streams_join_to_one_shot_decode(tok: Tokenizer, skip: bool):
    rng = random.Random(7)
    pool = list(range(256)) * 2 + [EOM, MEDIA_PAD, 300, 511] + list(range(0x80, 0x100))
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        text, reasoning, stopped = joined(stream(tok, ids, random_chunks(rng, len(ids)), skip_special_tokens=skip))
        assert (text, reasoning, stopped) == (tok.decode(ids, skip_special_tokens=skip), "", False)


def _strip_markup_reference(tok: Tokenizer, ids: Sequence[int]) -> str:
    """One-shot TXT-2: drop specials and everything from <|open|>/<|close|> through the next <|sep|>."""
    kept, in_markup = [], False
    for i in ids:
        if i in (OPEN, CLOSE):
            in_markup = True
        elif in_markup:
            in_markup = i != SEP
        elif not tok.is_special(i):
            kept.append(i)
    return tok.decode_bytes(kept).decode("utf-8", errors="replace")


def test_random_streams_with_markup_match_reference_and_one_shot(tok: Tokenizer):
    rng = random.Random(11)
    pool = [ord(c) for c in "thinkresponse "] + [0xE4, 0xB8, 0xAD, 0xF0, 0x9F] + [OPEN, CLOSE, SEP, SEP, EOM]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 50))]
        text, _, _ = joined(stream(tok, ids, random_chunks(rng, len(ids))))
        assert text == _strip_markup_reference(tok, ids)
        for opts in ({"split_reasoning": True}, {"split_reasoning": True, "skip_special_tokens": False},
                     {"split_reasoning": True, "stop_strings": ["ink", "e r"]}):
            assert joined(stream(tok, ids, random_chunks(rng, len(ids)), **opts)) == detokenize_all(tok, ids, **opts)


# ---- markup and reasoning ----------------------------------------------------------------------

ANSWER = "<|open|>response<|sep|>Hi 中<|close|>response<|sep|><|close|>message<|sep|>"
THINKING = "<|open|>think<|sep|>hmm…<|close|>think<|sep|>" + ANSWER


def test_markup_and_specials_produce_no_text(tok: Tokenizer):
    assert detokenize_all(tok, enc(tok, ANSWER + "<|end_of_msg|>")) == ("Hi 中", "", False)


def test_raw_mode_renders_everything(tok: Tokenizer):
    assert detokenize_all(tok, enc(tok, ANSWER), skip_special_tokens=False) == (ANSWER, "", False)


def test_markup_is_held_until_its_sep(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok)
    assert detok.push(enc(tok, "A<|open|>resp")).text == "A"
    assert detok.push(enc(tok, "onse<|sep|>B")).text == "B"


def test_unclosed_markup_at_end_produces_nothing(tok: Tokenizer):
    assert joined(stream(tok, enc(tok, "Hi<|open|>respo"))) == ("Hi", "", False)
    assert detokenize_all(tok, enc(tok, "Hi<|open|>re"), skip_special_tokens=False)[0] == "Hi<|open|>re"


def test_think_text_goes_to_reasoning_when_split(tok: Tokenizer):
    assert detokenize_all(tok, enc(tok, THINKING), split_reasoning=True) == ("Hi 中", "hmm…", False)
    assert detokenize_all(tok, enc(tok, THINKING)) == ("hmm…Hi 中", "", False)


def test_prompt_ending_in_think_starts_in_reasoning(tok: Tokenizer):
    ids = enc(tok, "plan<|close|>think<|sep|>" + ANSWER)
    assert detokenize_all(tok, ids, split_reasoning=True, in_think=True) == ("Hi 中", "plan", False)
    deltas = stream(tok, ids, split_reasoning=True, in_think=True)
    assert [d.reasoning for d in deltas if d.reasoning] == list("plan")


def test_raw_mode_split_puts_think_tags_in_reasoning(tok: Tokenizer):
    text, reasoning, _ = detokenize_all(tok, enc(tok, THINKING), split_reasoning=True, skip_special_tokens=False)
    assert reasoning == "<|open|>think<|sep|>hmm…<|close|>think<|sep|>"
    assert text == ANSWER


# ---- stop strings ------------------------------------------------------------------------------

def test_stop_string_held_back_across_tokens(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok, stop_strings=["wor"])
    outs = [detok.push([b]) for b in b"Hello wo"]
    assert "".join(d.text for d in outs) == "Hello "
    assert outs[-1].text == "" and outs[-2].text == ""
    last = detok.push([ord("r")])
    assert (last.text, last.stopped, last.tokens_used) == ("", True, 1)
    assert detok.push([ord("x")]) == Delta(stopped=True)
    assert detok.finish() == Delta(stopped=True)


def test_false_stop_prefix_is_released(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok, stop_strings=["abc"])
    assert [detok.push([b]).text for b in b"abab"] == ["", "", "ab", ""]
    assert detok.push([ord("x")]).text == "abx"
    assert detok.push([ord("a")]).text == ""
    assert detok.finish() == Delta(text="a")


@pytest.mark.parametrize("include,expected", [(False, "Hello "), (True, "Hello world")], ids=["exclude", "include"])
def test_stop_truncation(tok: Tokenizer, include: bool, expected: str):
    ids = list(b"Hello world and more")
    opts = {"stop_strings": ["world", "zzz"], "include_stop_str_in_output": include}
    assert detokenize_all(tok, ids, **opts) == (expected, "", True)
    assert joined(stream(tok, ids, **opts)) == (expected, "", True)


def test_stop_in_a_multi_token_push_reports_tokens_used(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok, stop_strings=["lo"])
    delta = detok.push(list(b"Hello there"))
    assert (delta.text, delta.stopped, delta.tokens_used) == ("Hel", True, 5)


def test_first_completed_stop_wins(tok: Tokenizer):
    assert detokenize_all(tok, list(b"xabcd"), stop_strings=["abcd", "bc"]) == ("xa", "", True)


def test_stop_string_spanning_multibyte_characters(tok: Tokenizer):
    ids = tok.encode("答案是：中文。再见", allow_special=False)
    assert detokenize_all(tok, ids, stop_strings=["中文。"]) == ("答案是：", "", True)
    assert joined(stream(tok, ids, stop_strings=["中文。"])) == ("答案是：", "", True)


def test_stop_strings_ignore_markup_and_reasoning(tok: Tokenizer):
    ids = enc(tok, "<|open|>think<|sep|>stop here<|close|>think<|sep|>answer")
    assert detokenize_all(tok, ids, stop_strings=["stop"], split_reasoning=True) == ("answer", "stop here", False)
    assert detokenize_all(tok, ids, stop_strings=["stop"]) == ("", "", True)
    assert detokenize_all(tok, ids, stop_strings=["think"]) == ("stop hereanswer", "", False)


def test_random_stop_streams_join_to_one_shot(tok: Tokenizer):
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("ab中") for _ in range(rng.randrange(0, 30)))
        ids = tok.encode(text, allow_special=False)
        stops = ["".join(rng.choice("ab中") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        for include in (False, True):
            opts = {"stop_strings": stops, "include_stop_str_in_output": include}
            got = joined(stream(tok, ids, random_chunks(rng, len(ids)), **opts))
            assert got == detokenize_all(tok, ids, **opts)
            cut = min(((text.find(s) + len(s), text.find(s), s) for s in stops if s in text), default=None)
            expected = text if cut is None else text[:cut[0] if include else cut[1]]
            assert got == (expected, "", cut is not None), (text, stops)


def test_empty_stop_string_is_rejected(tok: Tokenizer):
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(tok, stop_strings=["ok", ""])
