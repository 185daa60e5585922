"""Prompt sources -> token ids: the `messages` schema, image inputs, rendering, expansion (SERVING.md §5.1, §5.2).

Two halves. The checks that need no tokenizer (`parse_messages`, `parse_thinking`, `parse_images`)
are called by `serving.params.parse_request`. `build_request` then tokenizes a `ParsedRequest`,
expands the image placeholders, resolves `max_tokens` ([SMP-5]) and returns the engine `Request`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from k3backend.engine.request import Request
from k3backend.errors import InvalidArgument, Unsupported
from k3backend.tokenizer import Tokenizer

if TYPE_CHECKING:
    from k3backend.serving.params import ParsedRequest

MAX_MESSAGES = 1024
_HASH_RE = re.compile(r"[0-9a-f]{32}")
_MESSAGE_KEYS = {"role", "content", "name"}  # `name` is accepted and ignored
_PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}, "image": {"type", "image"}}


def parse_json(name: str, text: str) -> Any:
    """json.loads with the §7.2 message; hostile nesting and huge literals are client errors too ([ERR-3])."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{name} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"{name} is not valid JSON: {e}") from None


# ---- messages ([PRM-3]) and chat_template_kwargs ------------------------------------------------


def _check_part(where: str, part: Any) -> bool:
    """Validate one content part; True when it is an image part (one placeholder, [IMG-1])."""
    if not isinstance(part, dict):
        raise InvalidArgument(f"{where} must be an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind not in _PART_KEYS:
        raise InvalidArgument(f"{where}.type: unknown part type {kind!r}; expected text, image_url or image")
    unknown = sorted(set(part) - _PART_KEYS[kind])
    if unknown:
        raise InvalidArgument(f"{where}: unknown key {unknown[0]!r} in a {kind} part")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise InvalidArgument(f"{where}.text must be a string, got {type(part.get('text')).__name__}")
    if kind == "image_url":
        url = part.get("image_url")
        if isinstance(url, dict):
            if set(url) != {"url"} or not isinstance(url["url"], str):
                raise InvalidArgument(f'{where}.image_url must be {{"url": string}}, got keys {sorted(url)}')
        elif not isinstance(url, str):
            raise InvalidArgument(f'{where}.image_url must be a string or {{"url": string}}')
    if kind == "image" and "image" in part and not isinstance(part["image"], str):
        raise InvalidArgument(f"{where}.image must be a base64 string, got {type(part['image']).__name__}")
    return kind != "text"


def _check_message(where: str, message: Any) -> int:
    """Validate one message; returns its number of image parts."""
    if not isinstance(message, dict):
        raise InvalidArgument(f"{where} must be an object, got {type(message).__name__}")
    for key in ("tool_calls", "tool_call_id"):
        if key in message:
            raise Unsupported(f"{where}.{key}: tool calling is not supported")
    if message.get("role") == "tool":
        raise Unsupported(f"{where}.role: the tool role (tool calling) is not supported")
    unknown = sorted(set(message) - _MESSAGE_KEYS)
    if unknown:
        raise InvalidArgument(f"{where}: unknown key {unknown[0]!r}")
    role = message.get("role")
    if role not in ("system", "user", "assistant"):
        raise InvalidArgument(f"{where}.role must be system, user or assistant, got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return 0
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
    return sum(_check_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))


def parse_messages(text: str) -> tuple[list[dict[str, Any]], int]:
    """[PRM-3] the `messages` JSON -> (messages, number of image parts)."""
    messages = parse_json("messages", text)
    if not isinstance(messages, list):
        raise InvalidArgument(f"messages must be a JSON array, got {type(messages).__name__}")
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise InvalidArgument(f"messages must hold 1 to {MAX_MESSAGES} messages, got {len(messages)}")
    n_images = sum(_check_message(f"messages[{i}]", message) for i, message in enumerate(messages))
    return messages, n_images


def parse_thinking(text: str | None, default: bool) -> bool:
    """`chat_template_kwargs` (§2.2): a JSON object whose only key is `thinking` (a bool or null)."""
    if text is None:
        return default
    kwargs = parse_json("chat_template_kwargs", text)
    if not isinstance(kwargs, dict):
        raise InvalidArgument(f"chat_template_kwargs must be a JSON object, got {type(kwargs).__name__}")
    unknown = sorted(set(kwargs) - {"thinking"})
    if unknown:
        raise InvalidArgument(f"unknown key {unknown[0]!r} in chat_template_kwargs; the only key is 'thinking'")
    value = kwargs.get("thinking")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"chat_template_kwargs.thinking must be true or false, got {value!r}")
    return value


# ---- precomputed image inputs (§2.4, §4.2, [VIS-2]) ----------------------------------------------


@dataclass(frozen=True)
class ImageInputs:
    """The five internal image tensors of one request, checked against [VIS-2] and the LM hidden size."""

    embeds: torch.Tensor  # [ΣN_i, hidden], bf16 or fp32, on whatever device it arrived
    token_counts: tuple[int, ...]  # N_i
    grid_thw: tuple[tuple[int, int, int], ...]
    sizes: tuple[tuple[int, int], ...]  # (W0, H0) for the `image W0xH0` framing text
    hashes: tuple[str, ...]  # 32 lowercase hex: prefix-cache identity ([IMG-4])

    @property
    def n_images(self) -> int:
        return len(self.token_counts)


def _rows(name: str, arr: np.ndarray, width: int) -> list[tuple[int, ...]]:
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name}: expected an integer type, got {arr.dtype}")
    if width == 1:
        arr = arr.reshape(-1, 1)
    if arr.ndim != 2 or arr.shape[1] != width:
        raise InvalidArgument(f"{name}: expected shape [n_images, {width}], got {list(arr.shape)}")
    return [tuple(int(v) for v in row) for row in arr]


def _embeds(embeds: np.ndarray | torch.Tensor, hidden_size: int) -> torch.Tensor:
    if isinstance(embeds, np.ndarray):
        if embeds.dtype.kind != "f":
            raise InvalidArgument(f"image_embeds: expected BF16 or FP32, got {embeds.dtype}")
        embeds = torch.from_numpy(embeds if embeds.flags.writeable else embeds.copy())
    if not embeds.is_floating_point():
        raise InvalidArgument(f"image_embeds: expected BF16 or FP32, got {embeds.dtype}")
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise InvalidArgument(f"image_embeds: expected shape [rows, {hidden_size}] (the LM hidden size), "
                              f"got {list(embeds.shape)}")
    return embeds


def parse_images(embeds: np.ndarray | torch.Tensor, token_counts: np.ndarray, grid_thw: np.ndarray,
                 sizes: np.ndarray, hashes: Sequence[str], hidden_size: int) -> ImageInputs | None:
    """Check the internal image tensors (batch dim stripped) against [VIS-2] and §4.2; None for 0 images.

    embeds [ΣN_i, hidden] BF16/FP32 (numpy or torch); token_counts [n] int; grid_thw [n, 3] int;
    sizes [n, 2] int as (W0, H0); hashes n strings.
    """
    counts = [row[0] for row in _rows("image_token_counts", token_counts, 1)]
    grids = _rows("image_grid_thw", grid_thw, 3)
    whs = _rows("image_sizes", sizes, 2)
    n = len(counts)
    for name, rows in (("image_grid_thw", grids), ("image_sizes", whs), ("image_hashes", hashes)):
        if len(rows) != n:
            raise InvalidArgument(f"{name} has {len(rows)} entries but image_token_counts has {n}")
    rows = _embeds(embeds, hidden_size)
    if rows.shape[0] != sum(counts):
        raise InvalidArgument(f"image_embeds has {rows.shape[0]} rows but image_token_counts sums to {sum(counts)}")
    for i, (count, grid, (width, height), digest) in enumerate(zip(counts, grids, whs, hashes)):
        t, h, w = grid
        if t != 1 or count < 1 or count * 4 != h * w:
            raise InvalidArgument(f"image {i}: image_token_counts {count} does not match image_grid_thw "
                                  f"{tuple(grid)} (expected t = 1 and count = h*w/4)")
        if width < 1 or height < 1:
            raise InvalidArgument(f"image {i}: image_sizes must be positive, got {(width, height)}")
        if not _HASH_RE.fullmatch(digest):
            raise InvalidArgument(f"image {i}: image_hashes must be 32 lowercase hex characters, "
                                  f"got {digest[:40]!r}")
    if n == 0:
        return None
    return ImageInputs(rows, tuple(counts), tuple(grids), tuple(whs), tuple(hashes))  # type: ignore[arg-type]


# ---- ParsedRequest -> engine Request -------------------------------------------------------------


def _expand_images(ids: list[int], images: ImageInputs | None, tokenizer: Tokenizer) -> list[int]:
    """[IMG-2] placeholders == images, then [IMG-3] expansion with (W0, H0) and N_i."""
    if images is None and tokenizer.media_pad_id not in ids:
        return ids  # text-only fast path: every placeholder form holds a <|media_pad|>
    sizes, counts = (images.sizes, images.token_counts) if images is not None else ((), ())
    try:
        expanded, _ = tokenizer.expand_image_placeholders(ids, sizes, counts)
    except ValueError as e:  # placeholder / image count mismatch, bad size or count
        raise InvalidArgument(str(e)) from None
    return expanded


def _resolve_max_tokens(n_prompt: int, explicit: int | None, max_model_len: int, default_max_tokens: int) -> int:
    """[SMP-5]: absent -> min(default, room left). An explicit value is taken as is: the engine
    checks prompt + max_tokens against max_model_len, one place for direct and served requests."""
    if explicit is None:
        return max(1, min(default_max_tokens, max_model_len - n_prompt))
    return explicit


def ends_in_think(ids: Sequence[int], tokenizer: Tokenizer) -> bool:
    """True when the prompt's last markup is a complete `<|open|>think ...<|sep|>` ([TXT-3]).

    Then generation starts inside the think element, whose opening the detokenizer never sees
    (thinking=True chat prompts, or a text_input rendered that way by the client).
    """
    open_id, close_id, sep_id = (tokenizer.id_of(name) for name in ("<|open|>", "<|close|>", "<|sep|>"))
    backwards = list(reversed(ids))  # list.index runs in C: most prompts have no markup to find
    start = max((len(ids) - 1 - backwards.index(t) for t in (open_id, close_id) if t in backwards), default=None)
    if start is None or ids[start] != open_id:
        return False
    tail = list(ids[start + 1:])
    if sep_id not in tail:
        return False  # the prompt ends inside the markup itself
    words = tokenizer.decode(tail[:tail.index(sep_id)], skip_special_tokens=True).split(maxsplit=1)
    return bool(words) and words[0] == "think"


def bad_word_sequences(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """[STP-6]: each word as given and with a leading space, as ordinary text (PRM-4: never special)."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word):
            seq = tuple(tokenizer.encode(text, allow_special=False))
            if seq and seq not in seqs:
                seqs.append(seq)
    return tuple(seqs)


def build_request(parsed: ParsedRequest, tokenizer: Tokenizer, *, eos_ids: Sequence[int], max_model_len: int,
                  default_max_tokens: int) -> tuple[Request, str]:
    """Tokenize, expand images and resolve max_tokens; returns (Request, echo prompt for [TXT-4]).

    text_input is encoded verbatim with special literals allowed ([PRM-2]); messages are rendered
    with `thinking` ([PRM-4]). The echo text is the original text_input, or the rendered prompt
    with one `<|media_pad|>` per image (unexpanded).
    """
    if parsed.is_stop:
        raise ValueError("build_request: a stop request has no prompt")
    if parsed.messages is not None:
        try:
            rendered = tokenizer.render_chat(parsed.messages, thinking=parsed.thinking)
        except ValueError as e:  # parse_messages already checked the schema; kept as a client error
            raise InvalidArgument(str(e)) from None
        ids, echo = rendered.ids, rendered.text
    else:
        assert parsed.text_input is not None
        ids, echo = tokenizer.encode_text_input(parsed.text_input), parsed.text_input
    ids = _expand_images(ids, parsed.images, tokenizer)
    max_tokens = _resolve_max_tokens(len(ids), parsed.max_tokens, max_model_len, default_max_tokens)
    params = dataclasses.replace(parsed.sampling, max_tokens=max_tokens)  # re-validates min_tokens
    request = Request(
        request_id=parsed.request_id,
        prompt_ids=ids,
        params=params,
        eos_ids=tuple(eos_ids),
        image_embeds=None if parsed.images is None else parsed.images.embeds,
        image_token_counts=() if parsed.images is None else parsed.images.token_counts,
        image_hashes=() if parsed.images is None else parsed.images.hashes,
        bad_word_seqs=bad_word_sequences(params.bad_words, tokenizer),
        arrival_time=parsed.arrival_time,
    )
    return request, echo
