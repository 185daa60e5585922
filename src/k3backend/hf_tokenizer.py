"""The [PRM-5] Hugging Face tokenizer directory: `tokenizer.json` + `tokenizer_config.json`.

Spec: SERVING.md PRM-5 (used by GenAI-Perf `--tokenizer`, CMP-11, and the OpenAI frontend, CMP-13),
K3_VISION.md §6.1 (vocabulary, split regex, specials) and §6.2 (chat rendering).

The directory loads with `AutoTokenizer.from_pretrained(dir)` and no remote code: a plain
`tokenizers` byte-level BPE built from our tiktoken ranks, and a Jinja chat template equal to
`Tokenizer.render_chat` for text-only conversations. It is the same BPE, not an approximation:

- vocab: every rank's bytes spelled in GPT-2's byte-level alphabet, id = rank.
- merges: for every token of 2+ bytes, every split into two tokens that are both ranks, ordered by
  the merged token's rank (then the parts' ranks). tiktoken merges the adjacent pair whose
  concatenation has the lowest rank; listing *all* splits makes the pairs `tokenizers` may merge
  exactly the pairs tiktoken may merge, in the same priority order.
- `ignore_merges`: a regex piece that is itself a rank is one token, as in tiktoken (which looks a
  piece up before merging), even when no chain of merges reaches it.
- specials: all 256 slots as added special tokens (non-normalized, no strip), so their literals
  become their ids exactly as `Tokenizer.encode(text, allow_special=True)` does ([PRM-2]).

Known differences from `Tokenizer.encode` (all outside what clients send in practice):
- long runs: our encoder cuts every whitespace or non-whitespace run longer than 25 000 chars, and
  the text every 400 000 chars, before BPE (Moonshot's tokenization_kimi.py); `tokenizers` does
  not, so ids may differ around those cuts (a test pins the 25 000 cut).
- the split regex runs on Oniguruma here and on fancy-regex in tiktoken. The tests find no
  difference on random code points of every plane, but code points whose category or script
  differs between the two Unicode tables would split differently. Lone surrogates are refused by
  `tokenizers` (TypeError); tiktoken turns them into U+FFFD.
- tie order: when two different splits of one token are mergeable at two places of one piece at
  once, tiktoken merges the leftmost first and `tokenizers` the split listed first. The results
  differ only if a lower-ranked merge then takes the first-merged token; neither the test
  vocabularies nor a 163 584-rank vocabulary of random concatenations tried in development showed it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from k3backend.tokenizer import N_SPECIAL, PAT_STR, Tokenizer, read_tiktoken_ranks

logger = logging.getLogger(__name__)

# The role tokens of tokenizer_config.json, by default; each is written only where the slot is named.
DEFAULT_ROLE_TOKENS = {"bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]",
                       "unk_token": "[UNK]"}
_ADDED_FLAGS = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}

# K3_VISION.md §6.2 in Jinja, for transformers' environment (trim_blocks, lstrip_blocks, and the
# `raise_exception` global). Every tag strips whitespace, so only the `{{ }}` output is rendered.
# `thinking` is a template kwarg: a request's `chat_template_kwargs` splatted into
# `apply_chat_template(**kwargs)` as vLLM does, or, failing that, a `chat_template_kwargs` mapping
# passed whole; absent or null means the default, as in k3_lm. Image parts render as
# `<|media_pad|>`, as render_chat's default image_prompt does; text-only conversations are the
# [PRM-5] contract. transformers drops None-valued keys, so null content arrives undefined.
_CHAT_TEMPLATE = """\
{%- if (thinking is not defined or thinking is none) and chat_template_kwargs is mapping -%}
  {%- set thinking = chat_template_kwargs.get('thinking') -%}
{%- endif -%}
{%- if thinking is not defined or thinking is none -%}
  {%- set thinking = __DEFAULT_THINKING__ -%}
{%- elif thinking is not boolean -%}
  {{- raise_exception('chat_template_kwargs.thinking must be true or false') -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
    {{- raise_exception('messages[' ~ loop.index0 ~ '].role: expected system, user or assistant') -}}
  {%- endif -%}
  {{- '<|open|>message role="' ~ message['role'] ~ '"<|sep|>' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] -}}
  {%- elif message['content'] is defined and message['content'] is sequence
        and message['content'] is not mapping -%}
    {%- for part in message['content'] -%}
      {%- if part is not mapping -%}
        {{- raise_exception('content parts must be objects') -}}
      {%- elif part['type'] == 'text' and part['text'] is string -%}
        {{- part['text'] -}}
      {%- elif part['type'] in ['image', 'image_url'] -%}
        {{- '<|media_pad|>' -}}
      {%- else -%}
        {{- raise_exception('content parts must be text (with a string text), image_url or image') -}}
      {%- endif -%}
    {%- endfor -%}
  {%- else -%}
    {{- raise_exception('message content must be a string or a list of parts') -}}
  {%- endif -%}
  {{- '<|close|>message<|sep|><|end_of_msg|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|open|>message role="assistant"<|sep|>' -}}
  {{- '<|open|>think<|sep|>' if thinking else '<|open|>response<|sep|>' -}}
{%- endif -%}
"""


def chat_template(default_thinking: bool) -> str:
    """The K3 chat template (§6.2) with `thinking` defaulting to `default_thinking`.

    With `add_generation_prompt=True` the output equals `render_chat(messages, thinking=...).text`.
    With it false (transformers' default) the assistant opening is left off: the output is the
    conversation alone, a prefix of what `k3_lm` renders ([PRM-4] always appends the opening).
    """
    return _CHAT_TEMPLATE.replace("__DEFAULT_THINKING__", "true" if default_thinking else "false")


def byte_alphabet() -> list[str]:
    """GPT-2's `bytes_to_unicode`: byte b -> one printable char, so byte strings become str tokens.

    Printable Latin-1 bytes map to themselves; the other 68 bytes to U+0100.. in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + i)
    return [chars[b] for b in range(256)]


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every multi-byte rank into two ranks, ordered by (merged, left, right) rank.

    A token no split reaches gets no merge: tiktoken only ever emits it as a whole regex piece, and
    `ignore_merges` does the same.
    """
    keyed: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort()
    return [(left, right) for *_, left, right in keyed]


def tokenizer_json(ranks: dict[bytes, int], special_names: list[str]) -> dict[str, Any]:
    """`tokenizer.json` for the ranks (ids 0..N-1) and the 256 specials (ids N..N+255).

    Merges are written as "left right" strings: byte-level tokens never contain a space, and every
    `tokenizers` version reads that form.
    """
    alphabet = byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    n = len(ranks)
    if len(special_names) != N_SPECIAL:
        raise ValueError(f"expected {N_SPECIAL} special names, got {len(special_names)}")
    vocab = {spell(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    clashes = [name for name in special_names if name in vocab]
    if clashes:  # one string cannot name two ids in tokenizers
        raise ValueError(f"special tokens {clashes[:3]} are also ordinary ranks "
                         f"({[vocab[c] for c in clashes[:3]]}); tokenizer.json cannot hold both")
    added = [{"id": n + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, name in enumerate(special_names)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": None,  # nothing is added around the text ([PRM-2]: no BOS)
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True, "vocab": vocab,
                  "merges": [f"{spell(left)} {spell(right)}" for left, right in derive_merges(ranks)]},
    }


def tokenizer_config(special_names: list[str], n_ranks: int, source: dict[str, Any],
                     default_thinking: bool) -> dict[str, Any]:
    """`tokenizer_config.json`: readable by transformers and by `Tokenizer.from_dir` alike.

    `added_tokens_decoder` names all 256 slots (reserved ones by their positional names, which
    `Tokenizer.from_dir` accepts). Role tokens come from the source config where it names a
    special slot, else from DEFAULT_ROLE_TOKENS; a role whose token is unnamed is left out rather
    than letting transformers add a new token. The source's `auto_map` / `tokenizer_class` (Kimi's
    remote-code TikTokenTokenizer) are deliberately not carried over.
    """
    names = set(special_names)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(n_ranks + i): {"content": name, **_ADDED_FLAGS}
                                 for i, name in enumerate(special_names)},
    }
    for key, default in DEFAULT_ROLE_TOKENS.items():
        value = source.get(key, default)
        if isinstance(value, dict):  # the serialized AddedToken form
            value = value.get("content")
        if isinstance(value, str) and value in names:
            config[key] = value
        else:
            logger.warning("%s %r is not a special token of this vocabulary; left out", key, value)
    config.update({"clean_up_tokenization_spaces": False, "chat_template": chat_template(default_thinking)})
    return config


def write_hf_tokenizer(tokenizer_dir: Path, out_dir: Path, *, default_thinking: bool = False) -> Path:
    """Write the [PRM-5] directory for a tokenizer dir that `Tokenizer.from_dir` loads.

    `out_dir` may be `tokenizer_dir` itself: `tokenizer_config.json` is replaced by a superset
    that `Tokenizer.from_dir` still reads the same way. `default_thinking` should match k3_lm's
    `default_thinking` parameter. Returns `out_dir`.
    """
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    tok = Tokenizer.from_dir(tokenizer_dir)  # validates the ranks and the special table
    ranks = read_tiktoken_ranks(tokenizer_dir / "tiktoken.model")
    special_names = sorted(tok.special_ids, key=tok.special_ids.__getitem__)
    source_path = tokenizer_dir / "tokenizer_config.json"
    source = json.loads(source_path.read_text()) if source_path.is_file() else {}

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "tiktoken.model").resolve() != (tokenizer_dir / "tiktoken.model").resolve():
        # Keep the directory loadable by Tokenizer.from_dir too (k3_lm and this file agree by construction).
        (out_dir / "tiktoken.model").write_bytes((tokenizer_dir / "tiktoken.model").read_bytes())
    body = tokenizer_json(ranks, special_names)
    (out_dir / "tokenizer.json").write_text(json.dumps(body, ensure_ascii=False) + "\n", encoding="utf-8")
    config = tokenizer_config(special_names, tok.n_ranks, source, default_thinking)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    logger.info("wrote HF tokenizer to %s: %d ranks, %d merges, %d specials, default thinking %s",
                out_dir, len(ranks), len(body["model"]["merges"]), N_SPECIAL, default_thinking)
    return out_dir
