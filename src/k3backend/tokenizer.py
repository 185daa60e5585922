"""K3 tokenizer: tiktoken BPE with 256 special slots, XTML chat rendering, image placeholders.

Spec: K3_VISION.md §6.1 (vocabulary, split regex, special tokens), §6.2 (chat rendering), §6.3
(placeholder expansion); SERVING.md PRM-2, PRM-4, IMG-1, IMG-3.

One class serves the real K3 vocabulary (163 584 ranks + 256 specials) and the tiny checkpoint's
byte-level one (256 ranks + 256 specials): both are a `tiktoken.model` rank file plus a
`tokenizer_config.json`, and the specials always sit at the same offsets above the ranks.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import tiktoken

from k3backend.config import ConfigError, K3Config

logger = logging.getLogger(__name__)

N_SPECIAL = 256
# Named specials as offsets from the first special id (163 584 in K3, 256 in the tiny vocabulary).
K3_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
    "[start_header_id]": 6, "[end_header_id]": 7, "[EOT]": 9, "<|media_begin|>": 18,
    "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21, "<osagent_mode>": 65,
    "[UNK]": 254, "[PAD]": 255,
}
# Chat rendering and image expansion cannot work without these.
REQUIRED_SPECIALS = ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|media_begin|>",
                     "<|media_content|>", "<|media_end|>", "<|media_pad|>")
# K2 put its chat tokens on the ids K3 reuses (§6.1); loading one as the other renders garbage.
K2_CHAT_NAMES = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
MEDIA_PAD = "<|media_pad|>"
# Not a vocabulary token: callers replace it before BPE (IMG-1 item 1).
IMAGE_PLACEHOLDER_TEXT = "<|kimi_image_placeholder|>"

# Kimi's pat_str (tokenization_kimi.py). tiktoken's engine (fancy-regex over Rust regex) supports
# the `&&` class intersection; tests pin that Han runs and Latin runs split apart.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PAT_STR = "|".join((
    r"[\p{Han}]+",                                                    # a run of Han characters
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",  # Word, word's
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",  # WORD, WORDs
    r"\p{N}{1,3}",                                                    # digits in groups of 1-3
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",                                     # punctuation runs
    r"\s*[\r\n]+",                                                    # newlines with indentation
    r"\s+(?!\S)",                                                     # spaces not before a word
    r"\s+",
))
# tokenization_kimi.py encodes in pieces: at most 400k chars per tiktoken call, and no run of
# whitespace / non-whitespace over 25k chars (tiktoken issue #195). The cut changes ids, so we
# cut where the reference does.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
_RUN_RE = re.compile(r"\s+|\S+")  # `\s` in a str pattern is exactly str.isspace()


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered chat prompt: token ids, and the same prompt as text (special literals) for echo."""

    ids: list[int]
    text: str


def _split_long_runs(text: str, limit: int) -> list[str]:
    """`_split_whitespaces_or_nonwhitespaces` of tokenization_kimi.py: cut every `limit` chars of a run."""
    if len(text) <= limit:  # no run can be longer (every prompt of ordinary size: the scan is most of encode())
        return [text]
    cuts = [c for m in _RUN_RE.finditer(text) for c in range(m.start() + limit, m.end(), limit)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _encode_pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file (`base64(token) rank` per line).

    Not `tiktoken.load.load_tiktoken_bpe`: that caches by path under a temp dir, so a new file at a
    reused path could load stale ranks. Ranks must be exactly 0..N-1 because the specials follow N.
    """
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 2 fields")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {line[:60]!r} ({e})") from e
        if token in ranks:
            raise ValueError(f"{path}:{lineno}: token {token!r} listed twice (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    return ranks


def _special_names(config: dict[str, Any], n_ranks: int, where: str) -> list[str]:
    """Name all 256 slots: `added_tokens_decoder` where it names one, `<|reserved_token_{id}|>` else.

    Names are positional: a named slot has no reserved spelling (`<|reserved_token_163839|>` is
    ordinary text in K3 because 163839 is `[PAD]`).
    """
    names = [f"<|reserved_token_{n_ranks + i}|>" for i in range(N_SPECIAL)]
    decoder = config.get("added_tokens_decoder")
    if decoder is None:
        logger.info("%s: no added_tokens_decoder; using the K3 special-token table", where)
        decoder = {str(n_ranks + off): {"content": name} for name, off in K3_SPECIAL_OFFSETS.items()}
    for key, entry in decoder.items():
        try:
            tid = int(key)
        except ValueError:
            raise ValueError(f"{where}: added_tokens_decoder key {key!r} is not a token id") from None
        if not n_ranks <= tid < n_ranks + N_SPECIAL:
            raise ValueError(f"{where}: added_tokens_decoder id {tid} is outside the special slots "
                             f"{n_ranks}..{n_ranks + N_SPECIAL - 1}")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{where}: added_tokens_decoder[{key!r}] needs a string 'content', got {entry!r}")
        names[tid - n_ranks] = entry["content"]
    return names


def synthetic_ranks(n_ranks: int) -> list[bytes]:
    """The tokens of a synthetic vocabulary of `n_ranks` ranks, in rank order (deterministic).

    Ranks 0..255 are the single bytes, then " a".." z"; every further token joins two earlier
    tokens of lowercase letters (the first maybe space-led) of at most 5 bytes each. Each is thus a BPE
    merge of two ranks, so tiktoken and the Hugging Face BPE (hf_tokenizer.py) agree, and
    English-like text merges into multi-byte tokens, as with a real vocabulary. Presets whose model vocabulary is
    K3's (163 840 ids) get 163 584 of these, so every id the model can emit decodes.
    """
    if n_ranks < 256:
        raise ValueError(f"a byte-level vocabulary needs at least 256 ranks, got {n_ranks}")
    import random

    tokens = [bytes([b]) for b in range(256)]
    letters = [bytes([c]) for c in range(ord("a"), ord("z") + 1)]
    tokens += [b" " + c for c in letters][:n_ranks - 256]  # " " + letter: the first merges
    seen = set(tokens)
    lefts, rights = letters + tokens[256:], list(letters)  # a new token is a left part + a right part
    rng = random.Random(n_ranks)
    while len(tokens) < n_ranks:
        token = rng.choice(lefts) + rng.choice(rights)
        if token in seen:
            continue
        seen.add(token)
        tokens.append(token)
        if len(token) <= 5:  # short tokens are the parts of longer ones (at most 10 bytes)
            lefts.append(token)
            if token[0] != 32:  # letters only: may also end a word
                rights.append(token)
    return tokens


def write_tokenizer(out_dir: Path, n_ranks: int) -> None:
    """Write a synthetic vocabulary of `n_ranks` ranks (`synthetic_ranks`) + the 256 K3 special
    slots, plus the Hugging Face files of the same vocabulary (SERVING.md PRM-5)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(synthetic_ranks(n_ranks))]
    (out_dir / "tiktoken.model").write_text("\n".join(lines) + "\n")
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    decoder = {str(n_ranks + off): {"content": name, **flags}
               for name, off in sorted(K3_SPECIAL_OFFSETS.items(), key=lambda kv: kv[1])}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>",
              "pad_token": "[PAD]", "unk_token": "[UNK]"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # The checkpoint dir doubles as the [PRM-5] Hugging Face tokenizer dir (tokenizer.json + template).
    from k3backend.hf_tokenizer import write_hf_tokenizer  # imports this module

    write_hf_tokenizer(out_dir, out_dir)


def write_tiny_tokenizer(out_dir: Path) -> None:
    """The tiny checkpoint's vocabulary: 256 single-byte ranks + the 256 K3 special slots.

    Every byte is its own token, so multi-byte characters always span tokens: that is what makes
    the tiny model a good test of UTF-8-safe streaming.
    """
    write_tokenizer(out_dir, 256)


def check_tokenizer_matches(config: K3Config, tokenizer: Tokenizer) -> None:
    """Raise ConfigError unless the tokenizer fits the model config.json describes.

    The vocabularies must be the same size: the model may sample any id below vocab_size, and every
    id of the tokenizer must have an embedding row. The special ids config.json names must be the
    tokenizer's: bos_token_id its `[BOS]`, each eos_token_id one of its 256 special slots, and
    media_placeholder_token_id (where config.json states it, or the model has a vision tower) its
    `<|media_pad|>`.
    """
    vocab = config.text.vocab_size
    if tokenizer.vocab_size != vocab:
        raise ConfigError(f"tokenizer: {tokenizer.vocab_size} token ids ({tokenizer.n_ranks} ranks + {N_SPECIAL} "
                          f"specials) but text_config.vocab_size is {vocab}; they must be equal")
    specials = range(tokenizer.n_ranks, tokenizer.vocab_size)
    bos = tokenizer.special_ids.get("[BOS]")
    if config.bos_token_id is not None and config.bos_token_id != bos and (bos is not None
                                                                         or config.bos_token_id not in specials):
        raise ConfigError(f"bos_token_id: {config.bos_token_id} in config.json but the tokenizer's [BOS] is {bos}")
    for eos in config.eos_token_id:
        if eos not in specials:
            raise ConfigError(f"eos_token_id: {eos} in config.json is not a special token of the tokenizer "
                              f"(ids {specials.start}..{specials.stop - 1})")
    stated = "media_placeholder_token_id" in config.raw or "media_placeholder_token_id" in config.raw.get(
        "text_config", {}) or config.vision is not None
    if stated and config.media_placeholder_token_id != tokenizer.media_pad_id:
        raise ConfigError(f"media_placeholder_token_id: {config.media_placeholder_token_id} in config.json but "
                          f"the tokenizer's {MEDIA_PAD} is {tokenizer.media_pad_id}")


def split_text_placeholders(text: str) -> list[str]:
    """The text pieces around each literal `<|kimi_image_placeholder|>` (IMG-1 item 1).

    The literal is not a vocabulary token, so it is cut out before BPE; n placeholders give n+1
    pieces, and one `<|media_pad|>` goes between consecutive pieces.
    """
    return text.split(IMAGE_PLACEHOLDER_TEXT)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


# A segment is (text, is_control): control text may contain special literals, plain text may not.
Segment = tuple[str, bool]


def _open_tag(tag: str, attrs: dict[str, str]) -> list[Segment]:
    attr_text = "".join(f' {k}="{_escape_attr(v)}"' for k, v in attrs.items())
    return [("<|open|>", True), (tag + attr_text, False), ("<|sep|>", True)]


def _close_tag(tag: str) -> list[Segment]:
    return [("<|close|>", True), (tag, False), ("<|sep|>", True)]


class Tokenizer:
    """K3 byte-level BPE over tiktoken with 256 special slots at ids n_ranks..n_ranks+255."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_names: Sequence[str], *, where: str = "tokenizer"):
        n = len(mergeable_ranks)
        if len(special_names) != N_SPECIAL:
            raise ValueError(f"{where}: expected {N_SPECIAL} special names, got {len(special_names)}")
        if len(set(special_names)) != N_SPECIAL:
            dup = sorted({s for s in special_names if list(special_names).count(s) > 1})
            raise ValueError(f"{where}: special token names repeat: {dup}")
        k2 = [s for s in special_names if s in K2_CHAT_NAMES]
        if k2:
            raise ValueError(f"{where}: names {k2} are Kimi-K2 chat tokens; this is not a K3 tokenizer")
        self.n_ranks: int = n
        self.vocab_size: int = n + N_SPECIAL
        self.special_ids: dict[str, int] = {name: n + i for i, name in enumerate(special_names)}
        missing = [s for s in REQUIRED_SPECIALS if s not in self.special_ids]
        if missing:
            raise ValueError(f"{where}: required special tokens {missing} are not named in the vocabulary")
        self._token_bytes: list[bytes] = [b""] * self.vocab_size
        for token, rank in mergeable_ranks.items():
            self._token_bytes[rank] = token
        for name, tid in self.special_ids.items():
            self._token_bytes[tid] = name.encode()
        self._enc = tiktoken.Encoding(where, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks,
                                      special_tokens=self.special_ids)
        self.eos_id: int = self.special_ids["<|end_of_msg|>"]
        self.media_pad_id: int = self.special_ids[MEDIA_PAD]

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tiktoken.model` + `tokenizer_config.json` (real K3 or the tiny byte-level vocabulary)."""
        path = Path(path)
        model = path / "tiktoken.model"
        if not model.is_file():
            raise FileNotFoundError(f"tokenizer dir {path}: missing tiktoken.model")
        ranks = read_tiktoken_ranks(model)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        tok = cls(ranks, _special_names(config, len(ranks), str(config_path)), where=str(path))
        logger.info("tokenizer loaded from %s: %d ranks + %d specials", path, tok.n_ranks, N_SPECIAL)
        return tok

    # ---- ids and text -------------------------------------------------------------------------

    def id_of(self, name: str) -> int:
        """Id of a special token by name (named or `<|reserved_token_{id}|>`)."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a special token of this tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return self.n_ranks <= token_id < self.vocab_size

    def encode(self, text: str, *, allow_special: bool) -> list[int]:
        """BPE-encode `text`; with allow_special, literal names of all 256 slots become their ids (PRM-2).

        With allow_special false the literals are ordinary characters (PRM-4: user content).
        """
        ids: list[int] = []
        for piece in _encode_pieces(text):
            ids += self._enc.encode(piece, allowed_special="all") if allow_special else self._enc.encode_ordinary(piece)
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes of `ids`; a special token renders as its name."""
        table = self._token_bytes
        try:
            if min(ids, default=0) < 0:
                raise IndexError
            return b"".join([table[i] for i in ids])
        except IndexError:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}") from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode with errors='replace'; skipping drops special tokens only (tag markup is the detokenizer's)."""
        if skip_special_tokens:
            ids = [i for i in ids if not self.is_special(i)]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def encode_text_input(self, text: str) -> list[int]:
        """Tokens of a raw `text_input` (PRM-2): specials allowed, each literal image placeholder -> one pad."""
        ids: list[int] = []
        for i, piece in enumerate(split_text_placeholders(text)):
            if i:
                ids.append(self.media_pad_id)
            ids += self.encode(piece, allow_special=True)
        return ids

    # ---- chat rendering (K3_VISION.md §6.2) ---------------------------------------------------

    def render_chat(self, messages: list[dict], *, thinking: bool, image_prompt: str = MEDIA_PAD) -> RenderedPrompt:
        """Render messages in K3's XTML format and append the assistant generation prompt (PRM-4).

        Each image part becomes `image_prompt` as a control segment, so by default one
        `<|media_pad|>` per image, SGLang's contract (§6.2). A literal `<|kimi_image_placeholder|>`
        in message text stays text: with `messages`, only image parts are placeholders (IMG-1).
        """
        segments: list[Segment] = []
        for i, message in enumerate(messages):
            segments += self._message_segments(i, message, image_prompt)
        # vLLM's copy of encoding_k3.py also puts a system "thinking-effort" message (effort "max")
        # first when thinking is on; K3_VISION.md §6.2 / §9 item 4 mark it UNCERTAIN whether the
        # checkpoint does, so it is left out here.
        segments += _open_tag("message", {"role": "assistant"})
        segments += _open_tag("think" if thinking else "response", {})
        return self._encode_segments(segments)

    def _message_segments(self, index: int, message: Any, image_prompt: str) -> list[Segment]:
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}]: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{index}].role: expected system, user or assistant, got {role!r}")
        segments = _open_tag("message", {"role": role})
        content = message.get("content")
        if isinstance(content, str):
            segments.append((content, False))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                segments.append(self._part_segment(f"messages[{index}].content[{j}]", part, image_prompt))
        else:
            raise ValueError(f"messages[{index}].content: expected a string or a list of parts, "
                             f"got {type(content).__name__}")
        return segments + _close_tag("message") + [("<|end_of_msg|>", True)]

    @staticmethod
    def _part_segment(where: str, part: Any, image_prompt: str) -> Segment:
        if not isinstance(part, dict):
            raise ValueError(f"{where}: expected an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.text: expected a string, got {type(part.get('text')).__name__}")
            return part["text"], False
        if kind in ("image", "image_url"):
            return image_prompt, True
        raise ValueError(f"{where}.type: unknown part type {kind!r}; expected text, image_url or image")

    def _encode_segments(self, segments: list[Segment]) -> RenderedPrompt:
        """Encode each run of same-kind segments on its own.

        Adjacent plain segments are joined first, so for content without special literals the ids
        equal encode(text, allow_special=True): tiktoken cuts at specials anyway.
        """
        runs = [("".join(text for text, _ in group), control)
                for control, group in groupby(segments, key=lambda seg: seg[1])]
        ids = [i for text, control in runs for i in self.encode(text, allow_special=control)]
        return RenderedPrompt(ids=ids, text="".join(text for text, _ in runs))

    # ---- image placeholders (K3_VISION.md §6.3, SERVING.md IMG-1 / IMG-3) ----------------------

    def find_image_placeholders(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """[start, end) spans of image placeholders in `ids`, in order (IMG-1 items 2 and 3).

        A complete block `<|media_begin|>` + non-special tokens + `<|media_content|><|media_pad|>
        <|media_end|>` is one placeholder (the HF reference prompt); any other `<|media_pad|>` is
        one placeholder on its own.
        """
        spans: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] == self.special_ids["<|media_begin|>"]:
                end = self._framing_block_end(ids, i)
                if end is not None:
                    spans.append((i, end))
                    i = end
                    continue
            elif ids[i] == self.media_pad_id:
                spans.append((i, i + 1))
            i += 1
        return spans

    def _framing_block_end(self, ids: Sequence[int], start: int) -> int | None:
        j = start + 1
        while j < len(ids) and not self.is_special(ids[j]):
            j += 1
        tail = [self.special_ids["<|media_content|>"], self.media_pad_id, self.special_ids["<|media_end|>"]]
        if j == start + 1 or list(ids[j:j + 3]) != tail:
            return None
        return j + 3

    def image_block(self, size: tuple[int, int], count: int) -> list[int]:
        """`<|media_begin|>image {W}x{H}<|media_content|>` + count pads + `<|media_end|>` (§6.3)."""
        width, height = size
        head = self.encode(f"<|media_begin|>image {width}x{height}<|media_content|>", allow_special=True)
        return head + [self.media_pad_id] * count + [self.special_ids["<|media_end|>"]]

    def expand_image_placeholders(self, ids: Sequence[int], sizes: Sequence[tuple[int, int]],
                                  counts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Replace placeholder i by image i's block of counts[i] pads (IMG-3).

        `sizes` are the original (width, height). Returns the new ids and each image's [start, end)
        span of pad positions, where its embedding rows go.
        """
        spans = self.find_image_placeholders(ids)
        if len(spans) != len(sizes):
            verb = "was" if len(sizes) == 1 else "were"
            raise ValueError(f"the prompt has {_plural(len(spans), 'image placeholder')} but "
                             f"{_plural(len(sizes), 'image')} {verb} supplied")
        if len(counts) != len(sizes):
            raise ValueError(f"got {_plural(len(counts), 'image token count')} for {_plural(len(sizes), 'image')}")
        out: list[int] = []
        pad_spans: list[tuple[int, int]] = []
        prev = 0
        for (start, end), size, count in zip(spans, sizes, counts):
            if count < 1 or min(size) < 1:
                raise ValueError(f"image {len(pad_spans)}: size {tuple(size)} and token count {count} must be positive")
            out += ids[prev:start]
            block = self.image_block(size, count)
            first_pad = len(out) + len(block) - 1 - count
            pad_spans.append((first_pad, first_pad + count))
            out += block
            prev = end
        out += ids[prev:]
        return out, pad_spans
