"""Incremental, UTF-8-safe detokenization with K3 markup stripping, reasoning split and stop strings.

Spec: SERVING.md TXT-1..TXT-3 (output text), STP-3 (stop strings), STR-4..STR-6 (streaming deltas
and hold-back). The invariant everything here protects: joining the deltas of `push()` calls and
`finish()` gives exactly `detokenize_all()` of the same ids, however the ids were chunked.

Pipeline per token: ids -> bytes routed to a channel (text or reasoning; markup and skipped
specials dropped) -> one incremental UTF-8 decoder per channel -> stop-string matching on the text
channel only.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from k3backend.tokenizer import Tokenizer

TEXT, REASONING = 0, 1


@dataclass(frozen=True)
class Delta:
    """New output since the previous call.

    `stopped`: a stop string matched; callers stop generating, and no text follows. `tokens_used`:
    how many of the pushed ids were consumed: all, or up to and including the one that completed
    the stop string (STP-3: that token is the last one generated and counted).
    """

    text: str = ""
    reasoning: str = ""
    stopped: bool = False
    tokens_used: int = 0


def _utf8_decoder() -> codecs.IncrementalDecoder:
    # Holds back an incomplete trailing sequence (at most 3 bytes), turns bytes that can never
    # complete into U+FFFD at once, and its output joined equals bytes.decode(errors="replace").
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class IncrementalDetokenizer:
    """Turn output ids into text deltas for one request.

    Callers do not push the EOS / stop token that ended generation (STP-2: it produces no text).
    `in_think`: the prompt ended inside a `think` element (`<|open|>think<|sep|>`, thinking on),
    so output starts as reasoning. Without it the reasoning split cannot see the opening tag.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 stop_strings: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 split_reasoning: bool = False, in_think: bool = False):
        bad = [s for s in stop_strings if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"stop strings must be non-empty strings, got {bad!r}")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(stop_strings)
        # Every proper prefix of a stop string: a text tail equal to one of these is held back.
        self._stop_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._split = split_reasoning
        self._open, self._close, self._sep = (tokenizer.id_of(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))
        self._elements: list[str] = ["think"] if in_think else []  # tags opened and not yet closed
        self._markup: bytearray | None = None  # raw bytes of unfinished markup, None outside markup
        self._markup_tag = bytearray()  # the plain text after the last <|open|>/<|close|>
        self._markup_opens = True
        self._decoders = (_utf8_decoder(), _utf8_decoder())
        self._channel = self._current_channel()
        self._held = ""  # decoded text-channel tail that may start a stop string
        self._stopped = False
        self._finished = False

    # ---- public --------------------------------------------------------------------------------

    def push(self, ids: Sequence[int], *, check_stops: bool = True) -> Delta:
        """Consume newly generated ids; returns the text that is now safe to send.

        check_stops=False passes text through as if there were no stop strings (nothing held for
        them): the output is still below min_tokens ([STP-5]).
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self._stopped:
            return Delta(stopped=True)
        texts: list[str] = []
        reasonings: list[str] = []
        for n, token in enumerate(ids, 1):
            new = ["", ""]
            self._feed(token, new)
            reasonings.append(new[REASONING])
            text, stopped = self._match_stops(new[TEXT], check_stops)
            texts.append(text)
            if stopped:
                return Delta("".join(texts), "".join(reasonings), True, n)
        return Delta("".join(texts), "".join(reasonings), False, len(ids))

    def finish(self) -> Delta:
        """End of generation: flush held text; an incomplete UTF-8 tail becomes U+FFFD (TXT-1)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if self._stopped:
            return Delta(stopped=True)
        new = ["", ""]
        if self._markup is not None and not self._skip:
            self._emit(bytes(self._markup), new)  # raw mode shows even unclosed markup
        self._markup = None  # with skip_special_tokens, unclosed markup produces nothing (TXT-2)
        for channel in (TEXT, REASONING):
            new[channel] += self._decoders[channel].decode(b"", final=True)
        text, stopped = self._match_stops(new[TEXT])
        if not stopped:
            text, self._held = text + self._held, ""
        return Delta(text, new[REASONING], stopped, 0)

    # ---- token -> bytes -> channel text --------------------------------------------------------

    def _feed(self, token: int, new: list[str]) -> None:
        raw = self._tok.decode_bytes([token])
        special = self._tok.is_special(token)
        if token in (self._open, self._close):
            # Markup runs from <|open|> or <|close|> through the next <|sep|> (TXT-2); a nested
            # opener restarts the tag name but stays in the same markup.
            self._markup = (self._markup or bytearray()) + raw
            self._markup_tag = bytearray()
            self._markup_opens = token == self._open
        elif self._markup is not None:
            self._markup += raw
            if token == self._sep:
                self._end_markup(new)
            elif not special:
                self._markup_tag += raw
        elif not special or not self._skip:
            self._emit(raw, new)

    def _end_markup(self, new: list[str]) -> None:
        """Apply a finished tag to the element stack; in raw mode show it in the element it belongs to."""
        raw = bytes(self._markup or b"")
        parts = self._markup_tag.decode("utf-8", errors="replace").split(maxsplit=1)
        tag = parts[0] if parts else ""
        self._markup = None
        if self._markup_opens:
            self._elements.append(tag)
            self._switch_channel(new)
        if not self._skip:
            self._emit(raw, new)
        if not self._markup_opens and tag in self._elements:
            del self._elements[len(self._elements) - 1 - self._elements[::-1].index(tag):]
            self._switch_channel(new)

    def _current_channel(self) -> int:
        return REASONING if self._split and "think" in self._elements else TEXT

    def _switch_channel(self, new: list[str]) -> None:
        """A think boundary ends a segment: bytes left incomplete in the old channel become U+FFFD."""
        channel = self._current_channel()
        if channel != self._channel:
            new[self._channel] += self._decoders[self._channel].decode(b"", final=True)
            self._decoders[self._channel].reset()
            self._channel = channel

    def _emit(self, raw: bytes, new: list[str]) -> None:
        new[self._channel] += self._decoders[self._channel].decode(raw)

    # ---- stop strings (STP-3, STR-6) -----------------------------------------------------------

    def _match_stops(self, new_text: str, check: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit, stopped); keep a tail that could still start a stop string.

        The match that completes first wins (smallest end, then earliest start), as it would when
        generating token by token.
        """
        buf = self._held + new_text
        if not self._stops or not check:
            self._held = ""
            return buf, False
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        if best is not None:
            self._held, self._stopped = "", True
            end, start = best
            return buf[:end] if self._include_stop else buf[:start], True
        keep = next((k for k in range(min(len(buf), self._max_prefix), 0, -1)
                     if buf[-k:] in self._stop_prefixes), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False


def detokenize_all(tokenizer: Tokenizer, ids: Sequence[int], **options: object) -> tuple[str, str, bool]:
    """One-shot (text, reasoning, stopped) of `ids`: the value streaming deltas must join up to (TXT-1)."""
    detok = IncrementalDetokenizer(tokenizer, **options)  # type: ignore[arg-type]
    first, last = detok.push(ids), detok.finish()
    return first.text + last.text, first.reasoning + last.reasoning, first.stopped or last.stopped
