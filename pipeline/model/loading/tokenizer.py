"""A checkpoint's tokenizer, on the maintained ``tokenizers`` library, read from its files.

- CLIP's (``clip``: SD 1.x/2.x, SDXL, FLUX.1, the CLIP scorer), from ``vocab.json`` and
  ``merges.txt`` (or the BPE model of a ``tokenizer.json``): the text cleaned as
  transformers' ``CLIPTokenizer`` cleans it without ``ftfy`` (``clean_clip_text``: control
  characters dropped, whitespace collapsed, CJK ideographs split apart, NFC, lower case),
  its special tokens split out (the start and end tokens, wherever the cleaned text holds
  them, and the config's added ones: SDXL's second tokenizer pads with "!", a token of its
  own), split by CLIP's pattern, byte-level BPE with ``</w>`` ending each word, the start
  and end tokens around it, as there.
- The rest (``from_json``: T5's, Qwen's) from ``tokenizer.json``, the library's own format,
  with the tokenizer config's pad token, length and chat template (``render_chat``,
  rendered as transformers' ``apply_chat_template`` renders it).

``Tokenizer.ids`` truncates each text to a length keeping the special tokens the
post-processor adds (CLIP's start and end, T5's ``</s>``) and pads it with the pad token, as
transformers' ``padding="max_length", truncation=True``: the token ids are those
transformers 4.57's tokenizers gave (tests/model/test_tokenizer.py, on every prompt of the suite).
The built-in random models' tokenizer files are written here too (``write_clip``,
``write_json``), as ``save_pretrained`` lays them out.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import unicodedata
from typing import Any

import numpy as np

# CLIP's split of cleaned text into words, numbers and the rest (its own pattern, as the
# ``regex`` module reads it; the ``tokenizers`` library's Oniguruma reads it alike)
CLIP_PATTERN = (r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"
                r"[^\s\p{L}\p{N}]+")
CLIP_MERGES_MOST = 49152 - 256 - 2  # CLIPTokenizer reads no more merges than its vocabulary holds
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# CJK ideographs (the CJK Unified Ideographs blocks and their extensions, the compatibility
# ideographs): a character each, spaced apart before the split, as BERT's basic tokenizer does
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be read; the message names the folder and the file."""


def byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE writes bytes as (GPT-2's): each printable byte
    as its own character, then every other byte, in byte order, as a character from 256 on.
    Listed in that order (the printable bytes' first), the order byte-level vocabularies
    number them in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return [chr(byte) for byte in printable] + [chr(256 + n) for n in range(len(others))]


def clean_clip_text(text: str) -> str:
    """``text`` as CLIP's tokenizer cleans it before the split (BERT's basic tokenizer's rules
    without accent stripping or punctuation splits): NUL, U+FFFD and control characters
    dropped, whitespace made spaces, CJK ideographs spaced apart, NFC, then split at
    whitespace, each word lower-cased, joined by single spaces."""
    kept = []
    for char in text:
        code = ord(char)
        category = unicodedata.category(char)
        if code in (0, 0xFFFD) or (category.startswith("C") and char not in "\t\n\r"):
            continue
        if char in " \t\n\r" or category == "Zs":
            kept.append(" ")
        elif any(low <= code <= high for low, high in _CJK):
            kept.append(f" {char} ")
        else:
            kept.append(char)
    words = unicodedata.normalize("NFC", "".join(kept)).split()
    return " ".join(" ".join(word.lower() for word in words).split())


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A tokenizer as promptmill uses one: the library's ``backend`` (no padding or truncation
    set: shared by threads), the longest sequence the checkpoint's text encoder takes
    (``model_max_length``, the tokenizer config's), its pad id, its special tokens by name,
    its chat template (or None), and CLIP's cleaning of the text (or None)."""
    backend: Any
    model_max_length: int
    pad_id: int
    special_tokens: dict
    chat_template: str | None = None
    clip: bool = False
    special_ids: tuple[int, ...] = ()  # CLIP's start and end tokens

    def _clip_tokens(self, text: str) -> list[int]:
        """CLIP's ids of ``text``, without the start and end tokens: the text cleaned
        (``clean_clip_text``), the special tokens in it (its own, and after cleaning) split
        out as transformers' CLIPTokenizer finds them, the rest encoded as plain text."""
        return self.backend.encode(clean_clip_text(text), add_special_tokens=False).ids

    def _wrapped(self, text: str, length: int | None) -> list[int]:
        """The ids of ``text`` with the special tokens the tokenizer adds around it, cut to
        ``length`` (None: whole) with those kept."""
        if self.clip:
            tokens = self._clip_tokens(text)
            if length is not None:
                tokens = tokens[:max(length - 2, 0)]
            return [self.special_ids[0], *tokens, self.special_ids[1]][:length]
        encoding = self.backend.encode(text, add_special_tokens=False)
        if length is not None:
            encoding.truncate(max(length - self.backend.num_special_tokens_to_add(False), 0))
        return self.backend.post_process(encoding).ids[:length]

    def counts(self, texts) -> list[int]:
        """How many tokens each text has, untruncated, the special tokens included."""
        return [len(self._wrapped(text, None)) for text in texts]

    def encode(self, texts, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [N, length], attention mask int32 [N, length]) of ``texts``: each cut to
        ``length`` tokens with its special tokens kept, then padded on the right."""
        ids = np.full((len(texts), length), self.pad_id, np.int32)
        mask = np.zeros((len(texts), length), np.int32)
        for row, text in enumerate(texts):
            tokens = self._wrapped(text, length)
            ids[row, :len(tokens)] = tokens
            mask[row, :len(tokens)] = 1
        return ids, mask

    def ids(self, texts, length: int | None = None) -> np.ndarray:
        """int32 [N, length] token ids (``encode``; ``length`` default ``model_max_length``)."""
        return self.encode(list(texts), self.model_max_length if length is None else length)[0]

    def render_chat(self, messages: list[dict], **kwargs) -> str:
        """``messages`` in the checkpoint's chat template, rendered as transformers'
        ``apply_chat_template(..., tokenize=False)`` renders it (a sandboxed Jinja environment
        with trimmed blocks, the special tokens and ``kwargs`` as variables)."""
        if not self.chat_template:
            raise TokenizerError("the tokenizer has no chat_template")
        return _compiled(self.chat_template).render(messages=messages, **self.special_tokens, **kwargs)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled once (compiling it costs a thousand times its rendering)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        import datetime

        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment.from_string(template)


def _read(folder: str, name: str, required: bool = True) -> Any:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if required:
            raise TokenizerError(f"{folder}: no {name}")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise TokenizerError(f"{path}: not JSON ({e})") from None


def _content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _settings(folder: str) -> tuple[dict, dict]:
    """(tokenizer_config.json, {special token name: content}): the special tokens of
    special_tokens_map.json, the config's over them."""
    config = _read(folder, "tokenizer_config.json", required=False)
    mapped = _read(folder, "special_tokens_map.json", required=False)
    specials = {name: _content(config.get(name, mapped.get(name))) for name in SPECIAL_NAMES}
    return config, {name: value for name, value in specials.items() if value is not None}


def _length(config: dict, default: int) -> int:
    value = config.get("model_max_length", default)
    return value if isinstance(value, int) and 0 < value < 10 ** 9 else default


def _chat_template(folder: str, config: dict) -> str | None:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def clip(folder: str, model_max_length: int = 77) -> Tokenizer:
    """CLIP's tokenizer in ``folder`` (``vocab.json`` and ``merges.txt``, or ``tokenizer.json``);
    TokenizerError naming what is missing."""
    from tokenizers import AddedToken, Regex, Tokenizer as Backend, models, pre_tokenizers

    config, specials = _settings(folder)
    if os.path.isfile(os.path.join(folder, "vocab.json")) or not os.path.isfile(os.path.join(folder,
                                                                                             "tokenizer.json")):
        vocab = _read(folder, "vocab.json")
        path = os.path.join(folder, "merges.txt")
        if not os.path.isfile(path):
            raise TokenizerError(f"{folder}: no merges.txt")
        with open(path, encoding="utf-8") as f:
            lines = f.read().strip().split("\n")[1:CLIP_MERGES_MOST + 1]
        merges = [tuple(line.split()) for line in lines if line]
    else:  # a fast tokenizer's file alone: its BPE model's vocabulary and merges
        model = _read(folder, "tokenizer.json").get("model", {})
        vocab = model.get("vocab")
        merges = [tuple(m.split()) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        if model.get("type") != "BPE" or not isinstance(vocab, dict):
            raise TokenizerError(f"{folder}: tokenizer.json is not a BPE tokenizer (CLIP's)")
    bos, eos = specials.get("bos_token", "<|startoftext|>"), specials.get("eos_token", "<|endoftext|>")
    unk = specials.get("unk_token", eos)
    pad = specials.get("pad_token", eos)
    for name, token in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
        if token not in vocab:
            raise TokenizerError(f"{folder}: the {name} {token!r} is not in the vocabulary")
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, continuing_subword_prefix="",
                                 end_of_word_suffix="</w>", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    added = {bos, eos, pad} | {_content(t) for t in config.get("added_tokens_decoder", {}).values()}
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in sorted(added)
                                if token in vocab])
    return Tokenizer(backend, _length(config, model_max_length), vocab[pad],
                     {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}, clip=True,
                     special_ids=(vocab[bos], vocab[eos]))


def from_json(folder: str, model_max_length: int) -> Tokenizer:
    """The tokenizer of ``folder``'s ``tokenizer.json`` (T5's, Qwen's), with its config's pad
    token, length (``model_max_length`` when it has none) and chat template."""
    from tokenizers import Tokenizer as Backend

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise TokenizerError(f"{folder}: no tokenizer.json (the tokenizers library's file, which "
                             f"save_pretrained writes for a fast tokenizer)")
    try:
        backend = Backend.from_file(path)
    except Exception as e:  # a truncated or foreign file
        raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
    backend.no_padding()
    backend.no_truncation()
    config, specials = _settings(folder)
    pad = specials.get("pad_token")
    pad_id = backend.token_to_id(pad) if pad is not None else None
    if pad_id is None:
        raise TokenizerError(f"{folder}: its pad token {pad!r} is not in the vocabulary")
    return Tokenizer(backend, _length(config, model_max_length), pad_id, specials, _chat_template(folder, config))


def _write(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def _added(content: str, normalized: bool = True) -> dict:
    return {"content": content, "lstrip": False, "normalized": normalized, "rstrip": False, "single_word": False}


def write_clip(folder: str, vocab: dict, merges: list[str], pad_token: str = "<|endoftext|>",
               model_max_length: int = 77) -> None:
    """A CLIP tokenizer's files, as transformers' ``CLIPTokenizer.save_pretrained`` lays them
    out (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(["#version: 0.2", *merges]) + "\n")
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    added = {str(vocab[token]): {**_added(token), "special": True} for token in (bos, eos)}
    if pad_token not in (bos, eos):
        added[str(vocab[pad_token])] = {**_added(pad_token, normalized=False), "special": True}
    _write(os.path.join(folder, "tokenizer_config.json"), {
        "added_tokens_decoder": added, "bos_token": bos, "clean_up_tokenization_spaces": False, "eos_token": eos,
        "errors": "replace", "extra_special_tokens": {}, "model_max_length": model_max_length, "pad_token": pad_token,
        "tokenizer_class": "CLIPTokenizer", "unk_token": eos})
    _write(os.path.join(folder, "special_tokens_map.json"), {
        "bos_token": _added(bos), "eos_token": _added(eos), "pad_token": pad_token if pad_token != eos else eos,
        "unk_token": _added(eos)})


def write_json(folder: str, backend, tokenizer_class: str, specials: dict, model_max_length: int,
               chat_template: str | None = None, *, special_map_as_strings: bool = False, **extra) -> None:
    """A fast tokenizer's files, as transformers' ``save_pretrained`` lays them out: the
    library's ``tokenizer.json``, tokenizer_config.json (its class, special tokens and their
    ids, length, ``extra``), special_tokens_map.json (each special token as its settings, or
    ``special_map_as_strings``: as its text, as a tokenizer given its special tokens as
    strings saves them) and the chat template (``chat_template.jinja``). The special tokens
    are added tokens of the backend, as transformers' fast tokenizers make them (split out of
    a text first, never normalised)."""
    from tokenizers import AddedToken

    os.makedirs(folder, exist_ok=True)
    backend.add_special_tokens([AddedToken(value, special=True, normalized=False)
                                for value in specials.values() if value is not None])
    backend.save(os.path.join(folder, "tokenizer.json"))
    added = {str(index): {**_added(token.content, normalized=False), "special": True}
             for index, token in sorted(backend.get_added_tokens_decoder().items())}
    config = {"added_tokens_decoder": added, "clean_up_tokenization_spaces": False, "extra_special_tokens": {},
              "model_max_length": model_max_length, "tokenizer_class": tokenizer_class, **specials, **extra}
    _write(os.path.join(folder, "tokenizer_config.json"), config)
    _write(os.path.join(folder, "special_tokens_map.json"),
           {name: value if special_map_as_strings else _added(value, normalized=False)
            for name, value in specials.items() if value is not None})
    if chat_template:
        with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(chat_template)
