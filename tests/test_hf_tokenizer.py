"""[PRM-5]: the Hugging Face tokenizer dir gives k3_lm's ids and k3_lm's chat rendering.

Two vocabularies: the tiny one (256 byte ranks, written in place into its dir as the checkpoint
does) and a BPE-trained "real-format" one (thousands of ranks with English, Chinese and emoji
merges, single bytes at shuffled ranks, a few ranks reachable only as whole pieces).
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no network, ever
import jinja2  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402

from k3backend.hf_tokenizer import byte_alphabet, derive_merges, write_hf_tokenizer  # noqa: E402
from k3backend.tokenizer import (  # noqa: E402
    K3_SPECIAL_OFFSETS,
    MAX_NO_WHITESPACES_CHARS,
    N_SPECIAL,
    PAT_STR,
    Tokenizer,
    write_tiny_tokenizer,
)

ENGLISH = """Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Readability counts; errors should never pass silently -- unless explicitly silenced. Now is better than never.
It's the user's job; they'll say we're done when I'd agree. YOU'RE RIGHT, SHE'S HERE, WE'VE GOT IT.
The quick brown fox jumps over the lazy dog 1234567890 times, doesn't it? Naïve café résumé.
def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # comment\n\n\tindent
"""
CHINESE = """中文分词是自然语言处理的基础。我们今天去北京大学看看，天气很好！
人工智能正在改变世界。模型的推理速度非常快，服务器支持流式输出。
这个问题很有意思，我们需要仔细想一想。你好，世界。
数据、算法和算力是三大要素；大家都说“学习使人进步”。
日本語の文章も少し：こんにちは、世界。한국어도 조금."""
EMOJI = ["\U0001f680", "\U0001f525", "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f4bb",
         "\U0001f1e8\U0001f1f3", "\u2764\ufe0f", "\U0001f389", "\u2728", "\U0001f914"]
# Pieces that become ranks without their prefixes: tiktoken emits them only as whole regex pieces.
WHOLE_ONLY = [" Zyzzyva", "\U0001f9ea\U0001f9ea", "ZZZZQ", "\u00e9t\u00e9\u00e9"]

CORPUS = [
    "", "a", "hello world", "Hello, World!", "  leading and trailing  ", "it's they'll we'RE I'd YOU'VE",
    "don't CAN'T o'clock 's 'S", "1 12 123 1234 12345 3.14159 -42 1e10 ٣٤٥ ½ Ⅻ",
    "中文分词是自然语言处理的基础。", "abc中文def", "日本語とカタカナ、한국어", "Naïve café ÀÉÎõü ǅungla İstanbul",
    "\U0001f680\U0001f525 rocket \U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    "\U0001f1e8\U0001f1f3\U0001f1ef\U0001f1f5 flags",
    "\u2764\ufe0f\u2764\ufe0f\u2764\ufe0f", "a  b   c    d", "\t\ttabs\t", "x\n\ny\r\n\r\nz\n", "   \n   \n",
    " \n\t \u3000\u00a0\u2003x\u2028y\u0085z", "line\n    indented\n\tcode();\n", "!!! ??? ... --- ***",
    "<div class=\"x\">&amp;</div>", "{{ jinja }} {% raw %} \\n \\\\", "a" * 300, " " * 200 + "x",
    "\n" * 50, "<|open|>message<|sep|>", "[BOS]hi[EOS][PAD][UNK]", "<|reserved_token_100000|>",
    "x<|media_pad|><|media_pad|>y", "<|open|<|sep|>>", "<|kimi_image_placeholder|>", "\x00\x01\x7f",
    "Zyzzyva Zyzzyva Zyzzyvas \U0001f9ea\U0001f9ea\U0001f9ea ZZZZQ ZZZZQQ \u00e9t\u00e9\u00e9",
    ENGLISH, CHINESE, "".join(EMOJI),
]
# The character pool for random strings: every split-regex class, multi-byte UTF-8, marks, specials.
POOL = (list("aAzZ09 '\n\r\t.,!?-_\"<>|[]{}()") + list("sStTdDmMlLrReEvV") + list("éÉßøΩπЖжالعربيةहिन्दी")
        + ["\u0301", "\u0308", "\u200d", "\ufe0f", "\u00a0", "\u3000", "\u2028", "\u0085", "\x0b", "\x0c"]
        + list("中文字人大学日本語カタ한국") + ["¹", "½", "٣", "Ⅻ"] + EMOJI + WHOLE_ONLY
        + ["<|open|>", "<|sep|>", "[EOS]", "<|end_of_msg|>", "<|media_pad|>"])


def random_strings(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    pooled = ["".join(rng.choices(POOL, k=rng.randrange(1, 40))) for _ in range(count)]
    # Any code point (no surrogates: tiktoken replaces them, tokenizers refuses them).
    code_points = ["".join(chr(rng.choice([rng.randrange(0x80), rng.randrange(0xD800),
                                           rng.randrange(0xE000, 0x110000)])) for _ in range(12))
                   for _ in range(count)]
    return pooled + code_points


def _training_text(rng: random.Random) -> list[str]:
    """Seeded English-like, Chinese and emoji lines: enough distinct pairs for ~4000 merges."""
    syllables = ["th", "e", "an", "in", "er", "on", "re", "at", "st", "ing", "tion", "qu", "ou", "al", "ly",
                 "ch", "sh", "oo", "pr", "ex", "co", "de", "mo", "ka", "zi", "ve", "ness", "ment", "ab"]
    words = ["".join(rng.choices(syllables, k=rng.randrange(1, 5))) for _ in range(1500)]
    han = CHINESE.replace("\n", "")
    lines = ENGLISH.splitlines() + CHINESE.splitlines()
    for _ in range(600):
        sentence = " ".join(rng.choices(words[:rng.randrange(50, 1500)], k=rng.randrange(4, 16)))
        chinese = "".join(han[i:i + rng.randrange(1, 5)] for i in rng.choices(range(len(han)), k=6))
        emoji = "".join(rng.choices(EMOJI, k=rng.randrange(1, 4)))
        number, word = rng.randrange(10**6), rng.choice(words)
        lines.append(f"{sentence.capitalize()}, {number}! {chinese}。 {emoji} it's {word}")
    return lines


def _train_ranks() -> list[bytes]:
    """~4000 BPE ranks learned from English, Chinese and emoji text, single bytes at shuffled ranks."""
    rng = random.Random(1)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(PAT_STR), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=4000, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(rng), trainer)
    decode = {c: b for b, c in enumerate(byte_alphabet())}
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    learned = [bytes(decode[c] for c in token) for token, _ in by_id]
    singles = [bytes([b]) for b in range(256)]
    rng.shuffle(singles)
    ranks = singles + [t for t in learned if len(t) > 1]
    return ranks + [w.encode() for w in WHOLE_ONLY if w.encode() not in ranks]


def _write_real_format(path: Path, ranks: list[bytes]) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate(ranks)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    decoder = {str(n + off): {"content": name, "special": True} for name, off in K3_SPECIAL_OFFSETS.items()}
    config = {"added_tokens_decoder": decoder, "tokenizer_class": "TikTokenTokenizer", "eos_token": "[EOS]",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _load_pair(path: Path) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_tokenizer(path)  # the checkpoint's own dir, written in place
    return _load_pair(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    src, out = tmp_path_factory.mktemp("trained_src"), tmp_path_factory.mktemp("trained_hf")
    _write_real_format(src, _train_ranks())
    write_hf_tokenizer(src, out, default_thinking=True)
    return _load_pair(out)


@pytest.fixture(params=["tiny", "trained"])
def pair(request: pytest.FixtureRequest):
    return request.getfixturevalue(request.param)


# ---- the vocabulary and its merges ----------------------------------------------------------------

def test_trained_vocab_has_multibyte_merges(trained):
    ours, hf = trained
    ranks = [ours.decode_bytes([i]) for i in range(ours.n_ranks)]
    assert 3000 < ours.n_ranks <= 4100
    assert ranks[:256] != [bytes([b]) for b in range(256)]  # single bytes are not at rank == byte
    assert "中文".encode() in ranks and "\U0001f680".encode() in ranks  # whole characters merged
    assert any(len(t) == 2 and t[0] >= 0xE0 for t in ranks)  # part of a 3-byte character
    assert len(hf) == ours.vocab_size


def test_merges_list_every_split_in_merged_rank_order():
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"bc": 257, b"abc": 258, b"xyz": 259}
    assert derive_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]  # xyz: none


def test_byte_alphabet_is_gpt2s():
    alphabet = byte_alphabet()
    assert len(set(alphabet)) == 256 and alphabet[ord("a")] == "a" and alphabet[ord(" ")] == "\u0120"
    assert alphabet[0] == "\u0100" and alphabet[0xAD] == "\u0143" and " " not in alphabet


def test_specials_are_added_special_tokens_at_their_ids(pair):
    ours, hf = pair
    assert len(hf) == ours.vocab_size
    for name, tid in ours.special_ids.items():
        assert hf.convert_tokens_to_ids(name) == tid
    assert (hf.bos_token_id, hf.pad_token_id, hf.unk_token_id) == (ours.id_of("[BOS]"), ours.id_of("[PAD]"),
                                                                   ours.id_of("[UNK]"))
    assert hf.decode([ours.id_of("<|open|>"), ours.n_ranks + 100], skip_special_tokens=True) == ""


def test_reserved_slot_literals_follow_the_slot_table(pair):
    ours, hf = pair
    reserved = f"a<|reserved_token_{ours.n_ranks + 8}|>b"
    assert hf.encode(reserved) == ours.encode(reserved, allow_special=True)
    assert ours.n_ranks + 8 in hf.encode(reserved)
    named = f"<|reserved_token_{ours.n_ranks}|>"  # slot 0 is [BOS]: this spelling is ordinary text
    assert hf.encode(named) == ours.encode(named, allow_special=True)
    assert max(hf.encode(named)) < ours.n_ranks


def test_tiny_eos_is_end_of_msg(tiny):
    ours, hf = tiny
    assert hf.eos_token_id == ours.eos_id


def test_source_remote_code_config_is_not_carried(tmp_path: Path):
    _write_real_format(tmp_path, [bytes([b]) for b in range(256)] + [b"ab"])
    before = Tokenizer.from_dir(tmp_path)
    write_hf_tokenizer(tmp_path, tmp_path)  # in place, as write_tiny_tokenizer does
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in config
    assert config["eos_token"] == "[EOS]"  # taken from the source config
    assert Tokenizer.from_dir(tmp_path).special_ids == before.special_ids


def test_config_rewrite_keeps_our_loader_unchanged(tmp_path: Path):
    write_tiny_tokenizer(tmp_path)
    before = Tokenizer.from_dir(tmp_path)
    write_hf_tokenizer(tmp_path, tmp_path / "again")
    after = Tokenizer.from_dir(tmp_path / "again")
    assert after.special_ids == before.special_ids and after.n_ranks == before.n_ranks
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_special_name_that_is_also_a_rank_is_refused(tmp_path: Path):
    _write_real_format(tmp_path, [bytes([b]) for b in range(256)] + [b"[BOS]"])
    with pytest.raises(ValueError, match=r"special tokens \['\[BOS\]'\] are also ordinary ranks"):
        write_hf_tokenizer(tmp_path, tmp_path / "out")


# ---- ids ([PRM-5]: the same ids as k3_lm) ------------------------------------------------------------

@pytest.mark.parametrize("text", CORPUS, ids=[f"corpus{i}" for i in range(len(CORPUS))])
def test_hf_ids_equal_ours(pair, text: str):
    ours, hf = pair
    expected = ours.encode(text, allow_special=True)
    assert hf.encode(text) == expected  # defaults: add_special_tokens adds nothing
    assert hf(text)["input_ids"] == expected


def test_hf_ids_equal_ours_on_random_strings(pair):
    ours, hf = pair
    texts = random_strings(seed=0, count=1500)
    got = hf(texts)["input_ids"]
    mismatches = [t for t, ids in zip(texts, got) if ids != ours.encode(t, allow_special=True)]
    assert mismatches == []


def test_split_regex_agrees_on_any_code_point(tmp_path: Path):
    """Every adjacent character pair is a rank, so a piece boundary anywhere shows up in the ids."""
    texts = random_strings(seed=2, count=400)
    ranks = {bytes([b]): b for b in range(256)}
    chars = [c.encode() for c in sorted({c for text in texts for c in text})]
    pairs = [(a + b).encode() for text in texts for a, b in zip(text, text[1:])]
    for token in [c[:k] for c in chars for k in range(2, len(c) + 1)] + pairs:
        ranks.setdefault(token, len(ranks))
    _write_real_format(tmp_path, sorted(ranks, key=ranks.__getitem__))
    write_hf_tokenizer(tmp_path, tmp_path)
    ours, hf = _load_pair(tmp_path)
    mismatches = [t for t, ids in zip(texts, hf(texts)["input_ids"]) if ids != ours.encode(t, allow_special=True)]
    assert mismatches == []
    assert sum(len(ids) < len(t) for t, ids in zip(texts, hf(texts)["input_ids"])) > len(texts) // 2  # pairs merged


def test_decode_round_trips(pair):
    ours, hf = pair
    for text in CORPUS + random_strings(seed=1, count=200):
        ids = ours.encode(text, allow_special=True)
        assert hf.decode(ids) == text == ours.decode(ids, skip_special_tokens=False)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["q" + "ab" * 12501, "中文字" * 9000], ids=["latin", "han"])
def test_runs_over_25k_chars_are_cut_by_ours_only(trained, text: str):
    """The one known difference (module docstring): tokenization_kimi.py cuts long runs, tokenizers doesn't."""
    ours, hf = trained
    cut = MAX_NO_WHITESPACES_CHARS
    assert ours.encode(text, allow_special=True) == hf.encode(text[:cut]) + hf.encode(text[cut:])
    assert ours.encode(text, allow_special=True) != hf.encode(text)
    assert ours.encode(text[:cut], allow_special=True) == hf.encode(text[:cut])


def test_whole_piece_only_ranks_are_one_token(trained):
    ours, hf = trained
    for word in WHOLE_ONLY:
        assert len(ours.encode(word, allow_special=False)) == 1
        assert hf.encode(word) == ours.encode(word, allow_special=False)


# ---- the chat template ([PRM-5]: byte-identical to the [PRM-4] renderer) ---------------------------

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "hello"}],
    "system_user_assistant": [
        {"role": "system", "content": "You are K3. Answer briefly."},
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And in 中文？ \U0001f914"},
    ],
    "text_parts": [{"role": "user", "content": [{"type": "text", "text": "first part, "},
                                                {"type": "text", "text": "second\n\npart"}]},
                   {"role": "assistant", "content": []}],
    "escaping": [{"role": "user", "content": 'a & b "quoted" <tag> {{ x }} {% if %} \\ \' \t\n  '},
                 {"role": "system", "content": "&amp; &quot; \u2028 \x00"}],
    "empty_and_whitespace": [{"role": "user", "content": ""}, {"role": "assistant", "content": "  \n"}],
}
# Text-identical, but the literals are specials once the rendered string is tokenized (k3_lm
# encodes message text as ordinary text): ids are compared only for CONVERSATIONS.
SPECIAL_LITERALS = [{"role": "user", "content": "say <|open|>message role=\"x\"<|sep|> and [EOS]"}]


def _render(hf, messages: list[dict], **kwargs) -> str:
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("thinking", [False, True], ids=["response", "think"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_template_renders_like_render_chat(pair, name: str, thinking: bool):
    ours, hf = pair
    messages = CONVERSATIONS[name]
    expected = ours.render_chat(messages, thinking=thinking)
    text = _render(hf, messages, **{"thinking": thinking})  # chat_template_kwargs, splatted as vLLM does
    assert text == expected.text
    assert _render(hf, messages, chat_template_kwargs={"thinking": thinking}) == expected.text  # passed whole
    assert hf.encode(text) == expected.ids
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, thinking=thinking)
    assert (ids["input_ids"] if hasattr(ids, "keys") else ids) == expected.ids  # a BatchEncoding in v5


def test_template_special_literals_in_content_render_as_text(pair):
    ours, hf = pair
    expected = ours.render_chat(SPECIAL_LITERALS, thinking=False)
    assert _render(hf, SPECIAL_LITERALS, thinking=False) == expected.text


def test_template_thinking_default_is_the_writers(tiny, trained):
    messages = CONVERSATIONS["one_user"]
    for (ours, hf), default in ((tiny, False), (trained, True)):
        expected = ours.render_chat(messages, thinking=default).text
        assert _render(hf, messages) == expected
        assert _render(hf, messages, thinking=None) == expected
        assert _render(hf, messages, chat_template_kwargs={"thinking": None}) == expected


def test_template_without_generation_prompt_is_the_conversation_alone(pair):
    ours, hf = pair
    messages = CONVERSATIONS["system_user_assistant"]
    full = ours.render_chat(messages, thinking=False).text
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, thinking=False)
    assert full == text + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def test_template_image_part_is_one_media_pad(tiny):
    ours, hf = tiny
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    assert _render(hf, messages) == ours.render_chat(messages, thinking=False).text


@pytest.mark.parametrize("messages,kwargs", [
    ([{"role": "tool", "content": "x"}], {}),
    ([{"role": "user", "content": None}], {}),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], {}),
    ([{"role": "user", "content": [{"type": "video"}]}], {}),
    ([{"role": "user", "content": "x"}], {"thinking": "yes"}),
], ids=["tool_role", "null_content", "non_string_text", "unknown_part", "non_bool_thinking"])
def test_template_refuses_what_k3_lm_refuses(tiny, messages: list[dict], kwargs: dict):
    _, hf = tiny
    with pytest.raises(jinja2.TemplateError, match="role|content|parts|thinking"):
        _render(hf, messages, **kwargs)


# ---- the command line -----------------------------------------------------------------------------

def test_cli_writes_a_loadable_dir(tmp_path: Path):
    write_tiny_tokenizer(tmp_path / "src")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "k3backend", "hf-tokenizer", "--tokenizer", str(tmp_path / "src"),
                    "--out", str(tmp_path / "out"), "--default-thinking"], check=True, env=env, capture_output=True)
    ours, hf = _load_pair(tmp_path / "out")
    assert len(hf) == ours.vocab_size == 256 + N_SPECIAL
    assert _render(hf, CONVERSATIONS["one_user"]).endswith("<|open|>think<|sep|>")
