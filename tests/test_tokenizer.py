"""Tokenizer: vocabulary loading, special literals (PRM-2), chat rendering (PRM-4), placeholders (IMG-1/3)."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest

from k3backend.tokenizer import (
    IMAGE_PLACEHOLDER_TEXT,
    K3_SPECIAL_OFFSETS,
    PAT_STR,
    Tokenizer,
    _open_tag,
    _split_long_runs,
    split_text_placeholders,
    write_tiny_tokenizer,
)

KIMI_PAT_STR = (
    r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ONE_TURN = ('<|open|>message role="user"<|sep|>hello<|close|>message<|sep|><|end_of_msg|>'
            '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
# Words whose every prefix becomes a rank, so BPE merges each to one token when it is one piece:
# what the split regex cut apart shows up as separate tokens.
MERGED_WORDS = ["hello", "Hello", " world", "it's", "IT'S", "1234", "o中", "中文", "   ", " b", "!!"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


def _write_real_format(path: Path, named: dict[str, int]) -> int:
    """A K3-format dir: bytes + merges in tiktoken.model, specials named at N + offset. Returns N."""
    ranks = [bytes([b]) for b in range(256)]
    for word in MERGED_WORDS:
        raw = word.encode()
        ranks += [raw[:k] for k in range(2, len(raw) + 1) if raw[:k] not in ranks]
    rng = random.Random(0)
    while len(ranks) < 300:  # filler so N is nowhere near 256
        filler = bytes(rng.randrange(128, 256) for _ in range(3))
        if filler not in ranks:
            ranks.append(filler)
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate(ranks)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    decoder = {str(n + off): {"content": name, "special": True} for name, off in named.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return n


@pytest.fixture(scope="module")
def real_format(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("real_tok")
    _write_real_format(path, K3_SPECIAL_OFFSETS)
    return Tokenizer.from_dir(path)


def pieces(tok: Tokenizer, text: str) -> list[bytes]:
    return [tok.decode_bytes([i]) for i in tok.encode(text, allow_special=False)]


# ---- vocabulary --------------------------------------------------------------------------------

def test_pat_str_is_kimis_split_regex():
    assert PAT_STR == KIMI_PAT_STR


def test_tiny_vocabulary_layout(tiny: Tokenizer):
    assert (tiny.n_ranks, tiny.vocab_size) == (256, 512)
    assert tiny.eos_id == tiny.id_of("<|end_of_msg|>") == 258
    assert tiny.media_pad_id == 277
    assert tiny.id_of("<|open|>") == 259 and tiny.id_of("[PAD]") == 511
    assert tiny.id_of("<|reserved_token_264|>") == 264
    assert tiny.is_special(256) and not tiny.is_special(255) and not tiny.is_special(512)
    with pytest.raises(ValueError, match="not a special token"):
        tiny.id_of("<|im_end|>")


@pytest.mark.parametrize("text", ["hello, world", "中文字符", "emoji \U0001f680\U0001f525", "a\x00b\r\n  c"],
                         ids=["ascii", "chinese", "emoji", "controls"])
def test_tiny_encodes_one_token_per_byte(tiny: Tokenizer, text: str):
    ids = tiny.encode(text, allow_special=False)
    assert ids == list(text.encode())
    assert tiny.decode(ids) == text


def test_real_format_dir_loads_with_n_not_256(real_format: Tokenizer):
    n = real_format.n_ranks
    assert n >= 300 and real_format.vocab_size == n + 256
    for name, off in K3_SPECIAL_OFFSETS.items():
        assert real_format.id_of(name) == n + off
    assert real_format.id_of(f"<|reserved_token_{n + 8}|>") == n + 8
    assert real_format.id_of(f"<|reserved_token_{n + 253}|>") == n + 253
    assert real_format.eos_id == n + 2 and real_format.media_pad_id == n + 21


def test_unnamed_slots_in_config_get_reserved_names(tmp_path: Path):
    n = _write_real_format(tmp_path, {k: v for k, v in K3_SPECIAL_OFFSETS.items() if k != "[BOS]"})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.id_of(f"<|reserved_token_{n}|>") == n
    assert "[BOS]" not in tok.special_ids


@pytest.mark.parametrize("text,expected", [
    ("hello", [b"hello"]),
    ("hello world", [b"hello", b" world"]),
    ("hello中文", [b"hello", "中文".encode()]),       # Han run never joins a Latin run (&& intersection)
    ("1234", [b"123", b"4"]),                           # digits in groups of at most three
    ("it's", [b"it's"]),
    ("IT'S", [b"IT'S"]),                                # the contraction is case-insensitive
    ("a    b", [b"a", b"   ", b" b"]),                  # \s+(?!\S) leaves one space to the word
    ("x!!", [b"x", b"!!"]),
], ids=["word", "two_words", "han_boundary", "digit_groups", "contraction", "upper_contraction",
        "space_lookahead", "punct_run"])
def test_split_regex_pieces(real_format: Tokenizer, text: str, expected: list[bytes]):
    assert pieces(real_format, text) == expected


def test_long_run_cut_matches_tokenization_kimi():
    def reference(s: str, limit: int) -> list[str]:  # tokenization_kimi.py, loop form
        out, run, is_space, start = [], 0, s[0].isspace() if s else False, 0
        for i, ch in enumerate(s):
            if is_space ^ ch.isspace():
                run, is_space = 1, ch.isspace()
            else:
                run += 1
                if run > limit:
                    out.append(s[start:i])
                    start, run = i, 1
        return out + [s[start:]]

    rng = random.Random(1)
    for _ in range(300):
        s = "".join(rng.choice("ab \n\u3000中") for _ in range(rng.randrange(0, 40)))
        limit = rng.randrange(1, 8)
        assert _split_long_runs(s, limit) == reference(s, limit), (s, limit)


def test_special_literals_encode_only_with_allow_special(tiny: Tokenizer):
    text = "<|open|>x<|reserved_token_300|>[PAD]"
    assert tiny.encode(text, allow_special=True) == [259, ord("x"), 300, 511]
    assert tiny.encode(text, allow_special=False) == list(text.encode())


def test_named_slot_has_no_reserved_spelling(tiny: Tokenizer):
    text = "<|reserved_token_258|>"  # slot 258 is <|end_of_msg|>
    assert tiny.encode(text, allow_special=True) == list(text.encode())


def test_decode_renders_or_skips_specials(tiny: Tokenizer):
    ids = [259, ord("h"), ord("i"), 261]
    assert tiny.decode_bytes(ids) == b"<|open|>hi<|sep|>"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|open|>hi<|sep|>"
    assert tiny.decode(ids) == "hi"
    assert tiny.decode([0xE4, 0xB8]) == "\ufffd"
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary 0..511"):
        tiny.decode_bytes([1, 512])
    with pytest.raises(ValueError, match="token id -1"):
        tiny.decode_bytes([-1])


@pytest.mark.parametrize("named,match", [
    ({**K3_SPECIAL_OFFSETS, "<|im_end|>": 2}, "Kimi-K2"),
    ({**K3_SPECIAL_OFFSETS, "[BOS]": 300}, "outside the special slots"),
    ({"[BOS]": 0, "[EOS]": 1}, r"required special tokens \['<\|end_of_msg\|>'"),
], ids=["k2_names", "id_outside_slots", "missing_chat_tokens"])
def test_bad_tokenizer_config_is_named(tmp_path: Path, named: dict[str, int], match: str):
    _write_real_format(tmp_path, named)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(tmp_path)


def test_bad_rank_file_names_the_line(tmp_path: Path):
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: expected 'base64\(token\) rank'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="ranks must be exactly 0..1"):
        Tokenizer.from_dir(tmp_path)


# ---- chat rendering ----------------------------------------------------------------------------

def test_one_user_turn_renders_exactly(tiny: Tokenizer):
    out = tiny.render_chat([{"role": "user", "content": "hello"}], thinking=False)
    assert out.text == ONE_TURN
    assert out.ids == tiny.encode(ONE_TURN, allow_special=True)


def test_real_format_render_equals_encoding_the_rendered_text(real_format: Tokenizer):
    out = real_format.render_chat([{"role": "user", "content": "hello world"}], thinking=True)
    assert out.ids == real_format.encode(out.text, allow_special=True)


def test_thinking_selects_think_opening(tiny: Tokenizer):
    out = tiny.render_chat([{"role": "user", "content": "hello"}], thinking=True)
    assert out.text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert "thinking-effort" not in out.text


def test_history_roles_render_as_messages(tiny: Tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    out = tiny.render_chat(msgs, thinking=False)
    assert out.text.startswith(
        '<|open|>message role="system"<|sep|>be brief<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|>yo<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>again<|close|>message<|sep|><|end_of_msg|>')


def test_user_special_literals_stay_text(tiny: Tokenizer):
    out = tiny.render_chat([{"role": "user", "content": "<|open|><|media_pad|>"}], thinking=False)
    plain = tiny.render_chat([{"role": "user", "content": "x"}], thinking=False)
    specials = [i for i in out.ids if tiny.is_special(i)]
    assert specials == [i for i in plain.ids if tiny.is_special(i)]
    assert "<|open|><|media_pad|>" in out.text


def test_image_parts_become_control_placeholders(tiny: Tokenizer):
    content = [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": "x"}},
               {"type": "text", "text": f" and {IMAGE_PLACEHOLDER_TEXT}"}, {"type": "image"}]
    out = tiny.render_chat([{"role": "user", "content": content}], thinking=False)
    assert f'<|sep|>see <|media_pad|> and {IMAGE_PLACEHOLDER_TEXT}<|media_pad|><|close|>' in out.text
    assert out.ids.count(tiny.media_pad_id) == 2  # the literal in message text is not a placeholder
    custom = tiny.render_chat([{"role": "user", "content": content}], thinking=False, image_prompt="<|media_begin|>")
    assert custom.ids.count(tiny.id_of("<|media_begin|>")) == 2


def test_attribute_values_are_escaped():
    assert _open_tag("message", {"name": 'a&"b'})[1] == ('message name="a&amp;&quot;b"', False)


@pytest.mark.parametrize("messages,match", [
    (["hello"], r"messages\[0\]: expected an object, got str"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"messages\[0\].content\[0\].type: unknown part type 'audio'"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\].text: expected a string"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\].role"),
    ([{"role": "user", "content": None}], r"messages\[0\].content: expected a string or a list"),
], ids=["non_dict", "unknown_part", "non_string_text", "bad_role", "no_content"])
def test_bad_messages_raise_value_error(tiny: Tokenizer, messages: list, match: str):
    with pytest.raises(ValueError, match=match):
        tiny.render_chat(messages, thinking=False)


# ---- image placeholders ------------------------------------------------------------------------

def test_text_input_placeholder_literal_becomes_one_pad(tiny: Tokenizer):
    text = f"a{IMAGE_PLACEHOLDER_TEXT}b{IMAGE_PLACEHOLDER_TEXT}"
    assert split_text_placeholders(text) == ["a", "b", ""]
    assert tiny.encode_text_input(text) == [ord("a"), 277, ord("b"), 277]
    assert tiny.encode_text_input("<|open|>") == [259]  # PRM-2: specials allowed in text_input


def test_find_placeholders_lone_pads_and_framing_blocks(tiny: Tokenizer):
    block = tiny.encode("<|media_begin|>image 12x34<|media_content|><|media_pad|><|media_end|>", allow_special=True)
    bare = tiny.encode("<|media_begin|><|media_content|><|media_pad|><|media_end|>", allow_special=True)
    ids = [ord("x"), 277] + block + bare + [277, 277]
    b0 = 2
    b1 = b0 + len(block)
    assert tiny.find_image_placeholders(ids) == [(1, 2), (b0, b1), (b1 + 2, b1 + 3), (b1 + 4, b1 + 5),
                                                 (b1 + 5, b1 + 6)]


def test_expand_replaces_each_placeholder_with_its_block(tiny: Tokenizer):
    framing = tiny.encode("<|media_begin|>image 1x1<|media_content|><|media_pad|><|media_end|>", allow_special=True)
    ids = [ord("a"), 277, ord("b")] + framing + [ord("c")]
    out, spans = tiny.expand_image_placeholders(ids, sizes=[(640, 480), (7, 9)], counts=[3, 2])
    first = tiny.encode("<|media_begin|>image 640x480<|media_content|>", allow_special=True)
    second = tiny.encode("<|media_begin|>image 7x9<|media_content|>", allow_special=True)
    end = tiny.id_of("<|media_end|>")
    assert out == ([ord("a")] + first + [277] * 3 + [end, ord("b")] + second + [277] * 2 + [end, ord("c")])
    assert [out[s:e] for s, e in spans] == [[277] * 3, [277] * 2]
    assert spans[0][0] == 1 + len(first)


def test_expand_count_mismatch_names_both_counts(tiny: Tokenizer):
    with pytest.raises(ValueError, match="^the prompt has 2 image placeholders but 1 image was supplied$"):
        tiny.expand_image_placeholders([277, 277], sizes=[(4, 4)], counts=[1])
    with pytest.raises(ValueError, match="the prompt has 0 image placeholders but 2 images were supplied"):
        tiny.expand_image_placeholders([1, 2], sizes=[(4, 4), (4, 4)], counts=[1, 1])


def test_no_placeholders_and_no_images_is_text_only(tiny: Tokenizer):
    assert tiny.expand_image_placeholders([1, 2, 3], sizes=[], counts=[]) == ([1, 2, 3], [])


# ---------------------------------------------------------------- synthetic vocabularies and config agreement
def test_synthetic_vocabulary_is_a_deterministic_bpe_of_byte_merges():
    from k3backend.tokenizer import synthetic_ranks

    ranks = synthetic_ranks(3000)
    assert ranks == synthetic_ranks(3000) and len(set(ranks)) == 3000
    assert ranks[:256] == [bytes([b]) for b in range(256)]
    known = set()
    for rank, token in enumerate(ranks):
        assert rank < 256 or any(token[:i] in known and token[i:] in known for i in range(1, len(token))), token
        known.add(token)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_every_preset_tokenizer_matches_its_config(tmp_path, preset):
    """make-checkpoint's tokenizer covers the preset's vocabulary with config.json's special ids."""
    from k3backend.config import K3Config
    from k3backend.presets import preset_config
    from k3backend.tokenizer import check_tokenizer_matches, write_tokenizer

    cfg = K3Config.from_dict(preset_config(preset))
    write_tokenizer(tmp_path, cfg.text.vocab_size - 256)
    tok = Tokenizer.from_dir(tmp_path)
    check_tokenizer_matches(cfg, tok)
    assert tok.vocab_size == cfg.text.vocab_size
    assert tok.decode_bytes(list(range(cfg.text.vocab_size)))  # every id the model can emit decodes
    assert tok.id_of("<|end_of_msg|>") in cfg.eos_token_id


def test_tokenizer_config_mismatches_name_both_numbers(tiny):
    import dataclasses

    from k3backend.config import ConfigError, K3Config
    from k3backend.presets import preset_config
    from k3backend.tokenizer import check_tokenizer_matches

    cfg = K3Config.from_dict(preset_config("tiny"))
    check_tokenizer_matches(cfg, tiny)
    small = K3Config.from_dict(preset_config("small"))
    with pytest.raises(ConfigError, match=r"tokenizer: 512 token ids \(256 ranks \+ 256 specials\) but "
                                          r"text_config.vocab_size is 163840"):
        check_tokenizer_matches(small, tiny)
    cases = {
        "bos_token_id": (dataclasses.replace(cfg, bos_token_id=257), r"bos_token_id: 257 .* \[BOS\] is 256"),
        "eos_token_id": (dataclasses.replace(cfg, eos_token_id=(258, 100)),
                         r"eos_token_id: 100 .* not a special token of the tokenizer \(ids 256..511\)"),
        "media_placeholder_token_id": (dataclasses.replace(cfg, media_placeholder_token_id=163605),
                                       r"media_placeholder_token_id: 163605 .* <\|media_pad\|> is 277"),
    }
    for what, (bad, message) in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_tokenizer_matches(bad, tiny)
