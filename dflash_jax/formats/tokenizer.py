"""Tokenizers (``tokenizers`` library) and chat templates (sandboxed jinja2).

Two sources:

* a GGUF file's ``tokenizer.ggml.*`` metadata: :meth:`Tokenizer.from_gguf`. ``tokenizer.ggml.model``
  ``gpt2`` is byte-level BPE whose pre-tokenizer follows ``tokenizer.ggml.pre``
  (:mod:`dflash_jax.formats.pretokenize`); ``llama`` and ``gemma4`` are SentencePiece-style BPE
  (:mod:`dflash_jax.formats.spm`). CONTROL tokens become special tokens, so ``<|im_start|>`` in a text is one id;
* a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``): :meth:`Tokenizer.from_hf_folder`.

Chat templates are rendered like transformers' ``apply_chat_template``: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that keeps non-ASCII.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from dflash_jax.formats.pretokenize import pre_tokenizer
from dflash_jax.formats.tokenizer_cache import read_tok_cache, write_tok_cache
from dflash_jax.errors import DFlashError


# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end-of-generation when they are control tokens (llama-vocab.cpp).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|end_of_text|>",
              "<｜end▁of▁sentence｜>", "<eos>", "<turn|>")
# ... and whatever their type: gemma4's converter writes <|tool_response> USER_DEFINED (shown in the output)
# while llama.cpp still ends generation there (the model waits for the tool's answer).
_EOG_ANY_TYPE = ("<|tool_response>",)
# OpenAI's harmony chat format (gpt-oss): an assistant turn ends with <|return|> (the final answer) or
# <|call|> (a tool call); <|end|> ends one message (the analysis channel's), after which the turn goes on.
_HARMONY_STOPS = ("<|return|>", "<|call|>")


def _with_harmony_stops(eos: list, token_id) -> list:
    """``eos`` (ids, ``None`` allowed) for a harmony vocabulary (one with a ``<|return|>`` token, as
    ``token_id(text) -> id | None`` finds it): plus ``<|return|>`` and ``<|call|>``, less ``<|end|>``
    (gpt-oss's ``generation_config.json`` lists 200002, 199999, 200012: return, endoftext, call).
    Other vocabularies: ``eos`` unchanged."""
    if token_id("<|return|>") is None:
        return eos
    end = token_id("<|end|>")
    return [i for i in [*eos, *map(token_id, _HARMONY_STOPS)] if i is None or i != end]


def _raise_exception(message):
    raise DFlashError("chat template", str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _compile_template(template: str, where: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise DFlashError(f"{where}: chat template", f"does not compile ({e})", "a jinja2 template") from None


class IncrementalDecoder:
    """Ids in, text out, one token at a time: ``tokenizers.decoders.DecodeStream`` bound to one
    tokenizer. Text that a later token could still change (an incomplete UTF-8 sequence) is held
    back until it is complete; what it releases is always a prefix of the whole decode."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream = tokenizer, DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text ``token_id`` completes (``""`` while it is held back)."""
        return self._stream.step(self._tok, int(token_id)) or ""


class Tokenizer:
    """A byte-level BPE tokenizer with special tokens, EOS ids and a chat template.

    Attributes:
      vocab_size: number of ids (``int``), including added/special tokens.
      eos_token_ids: ``tuple[int, ...]``; the first is the model's EOS, then EOT/EOM and other
        end-of-generation control tokens (llama.cpp's list; harmony's ``<|return|>`` and ``<|call|>``
        but not ``<|end|>`` for gpt-oss).
      bos_token_id / eos_token_id: ``int | None``.
      bos_token / eos_token: their texts (``""`` when absent), passed to the chat template.
      add_bos: whether :meth:`encode` prepends the BOS id by default.
      chat_template: the jinja2 source, or ``None``.
    """

    def __init__(
        self,
        tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool = False,
        chat_template: str | None = None,
        source: str = "tokenizer",
    ):
        self._tok = tokenizer
        self.source = source
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        eos = []
        for i in eos_token_ids:
            if i is not None and int(i) not in eos:
                eos.append(int(i))
        for i in eos:
            if not 0 <= i < self.vocab_size:
                raise DFlashError(f"{source}: eos token id", f"{i} outside the vocabulary of {self.vocab_size}")
        self.eos_token_ids = tuple(eos)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.add_bos = bool(add_bos) and self.bos_token_id is not None
        self.bos_token = self._text(self.bos_token_id)
        self.eos_token = self._text(self.eos_token_id)
        self.chat_template = chat_template
        self._template = _compile_template(chat_template, source) if chat_template else None

    def _text(self, i: int | None) -> str:
        if i is None:
            return ""
        t = self._tok.id_to_token(i)
        return "" if t is None else t

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path_or_reader, *, use_cache: bool = True) -> "Tokenizer":
        """Builds the tokenizer stored in a GGUF file's ``tokenizer.ggml.*`` metadata.

        ``tokenizer.ggml.model`` ``gpt2``: :meth:`from_vocab`; ``llama`` / ``gemma4``:
        :meth:`from_spm_vocab` (``add_space_prefix`` from ``tokenizer.ggml.add_space_prefix``, by
        default on for ``llama`` only; ``add_bos`` by default on for ``llama``, as llama.cpp reads them).

        Args:
          path_or_reader: a ``.gguf`` path or an open ``gguf.GGUFReader``.
          use_cache: with a path, read / write ``<path>.tokenizer.json`` (keyed by the GGUF's size
            and mtime) so later loads skip parsing the GGUF metadata (seconds for a 50k vocab).
        Raises:
          DFlashError: unreadable file; no tokenizer or an unsupported one (``tokenizer.ggml.model``
            other than ``gpt2``, ``llama``, ``gemma4``); an unsupported ``tokenizer.ggml.pre``; token /
            type / score lists of different lengths. Messages name the file and key.
        """
        from dflash_jax.formats.gguf_file import metadata, open_gguf, reader_name
        from dflash_jax.formats.spm import SPM_MODELS

        is_path = isinstance(path_or_reader, (str, os.PathLike))
        path = str(path_or_reader) if is_path else reader_name(path_or_reader)
        if is_path and use_cache:
            cached = read_tok_cache(path)
            if cached is not None:
                return cls(**cached, source=path)
        reader = open_gguf(path) if is_path else path_or_reader
        model = metadata(reader, "tokenizer.ggml.model")
        if model is None:
            raise DFlashError(f"{path}: metadata tokenizer.ggml.model", "missing", "a GGUF with an embedded tokenizer")
        if model != "gpt2" and model not in SPM_MODELS:
            raise DFlashError(f"{path}: metadata tokenizer.ggml.model", f"unsupported tokenizer {model!r}",
                              "'gpt2' (byte-level BPE), 'llama' or 'gemma4' (SentencePiece-style BPE)")
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        types = metadata(reader, "tokenizer.ggml.token_type")
        if not tokens:
            raise DFlashError(f"{path}: metadata tokenizer.ggml.tokens", "missing or empty", "the token list")
        if types is None:
            types = [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise DFlashError(f"{path}: metadata tokenizer.ggml.token_type", f"{len(types)} entries for {len(tokens)} tokens", "one per token")
        common = dict(
            bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata(reader, "tokenizer.ggml.eos_token_id"),
            extra_eos_ids=[metadata(reader, "tokenizer.ggml.eot_token_id"), metadata(reader, "tokenizer.ggml.eom_token_id")],
            add_bos=bool(metadata(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
            chat_template=metadata(reader, "tokenizer.chat_template"),
            source=path,
        )
        merges = metadata(reader, "tokenizer.ggml.merges") or []
        if model == "gpt2":
            tok = cls.from_vocab(tokens, merges, types, pre=metadata(reader, "tokenizer.ggml.pre"), **common)
        else:
            tok = cls.from_spm_vocab(tokens, types, scores=metadata(reader, "tokenizer.ggml.scores"), merges=merges,
                                     add_space_prefix=bool(metadata(reader, "tokenizer.ggml.add_space_prefix", model == "llama")),
                                     unk_token_id=metadata(reader, "tokenizer.ggml.unknown_token_id"), **common)
        if is_path and use_cache:
            write_tok_cache(path, tok)
        return tok

    @classmethod
    def from_vocab(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        *,
        pre: str | None = "gpt2",
        **common,
    ) -> "Tokenizer":
        """Builds a byte-level BPE tokenizer from GGUF-style lists.

        Args:
          tokens: id -> token text in byte-level form (``"Ġthe"``).
          merges: ``"a b"`` merge rules, highest priority first.
          token_types: llama.cpp token types (1 normal, 3 control, 4 user-defined, ...).
          pre: ``tokenizer.ggml.pre`` value selecting the pre-tokenizer.
          **common: ``bos_token_id``, ``eos_token_id``, ``extra_eos_ids`` (ids, ``None`` for absent),
            ``add_bos`` (prepend BOS in :meth:`encode`), ``chat_template`` (jinja2 source or ``None``),
            ``source`` (for messages); see :meth:`_with_added_tokens`.
        Raises:
          DFlashError: duplicate tokens, a malformed merge, or an unsupported ``pre``.
        """
        from tokenizers import decoders, models
        from tokenizers import Tokenizer as HFTokenizer

        source = common.get("source", "tokenizer")
        vocab = {}
        for i, t in enumerate(tokens):
            if t in vocab:
                raise DFlashError(f"{source}: metadata tokenizer.ggml.tokens", f"token {t!r} appears twice (ids {vocab[t]}, {i})", "unique tokens")
            vocab[t] = i
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise DFlashError(f"{source}: metadata tokenizer.ggml.merges", f"malformed merge {m!r}", "'left right'")
            pairs.append((parts[0], parts[1]))
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizer(pre, source)
        tok.decoder = decoders.ByteLevel()
        return cls._with_added_tokens(tok, tokens, token_types, special_types=(_CONTROL,), **common)

    @classmethod
    def from_spm_vocab(
        cls,
        tokens: Sequence[str],
        token_types: Sequence[int],
        *,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        add_space_prefix: bool = True,
        unk_token_id: int | None = None,
        **common,
    ) -> "Tokenizer":
        """Builds a SentencePiece-style BPE tokenizer (``▁`` spaces, ``<0xXX>`` byte fallback) from
        GGUF-style lists (:func:`dflash_jax.formats.spm.spm_tokenizer`).

        Args:
          tokens: id -> token text (``"▁the"``).
          token_types: llama.cpp token types; CONTROL and UNKNOWN tokens become special tokens,
            USER_DEFINED ones added tokens (each matched whole in a text).
          scores: ``tokenizer.ggml.scores``; merges are derived from them when ``merges`` is empty.
          merges: ``"a b"`` merge rules, highest priority first.
          add_space_prefix: put ``▁`` before a text that does not start with one.
          unk_token_id: the unknown token (default: the first UNKNOWN-type token).
          **common: as :meth:`from_vocab`.
        Raises:
          DFlashError: duplicate tokens, a malformed merge, neither merges nor matching scores.
        """
        from dflash_jax.formats.spm import spm_tokenizer

        if unk_token_id is None:
            unk_token_id = next((i for i, ty in enumerate(token_types) if ty == _UNKNOWN), None)
        unk = tokens[unk_token_id] if unk_token_id is not None and 0 <= unk_token_id < len(tokens) else None
        tok = spm_tokenizer(tokens, scores, merges, unk_token=unk, add_space_prefix=add_space_prefix,
                            source=common.get("source", "tokenizer"))
        return cls._with_added_tokens(tok, tokens, token_types, special_types=(_CONTROL, _UNKNOWN), **common)

    @classmethod
    def _with_added_tokens(cls, tok, tokens, token_types, *, special_types, bos_token_id=None, eos_token_id=None,
                           extra_eos_ids=(), add_bos=False, chat_template=None, source="tokenizer") -> "Tokenizer":
        """``tok`` (a ``tokenizers.Tokenizer``) plus the vocabulary's special tokens (types in
        ``special_types``) and user-defined tokens, with EOS ids: ``eos_token_id``, ``extra_eos_ids``,
        then control tokens named in llama.cpp's end-of-generation list (and harmony's stops)."""
        from tokenizers import AddedToken

        special = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(token_types) if ty in special_types]
        user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(token_types) if ty == _USER_DEFINED]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        eos = [eos_token_id, *extra_eos_ids]
        eos += [i for i, ty in enumerate(token_types) if (ty == _CONTROL and tokens[i] in _EOG_TEXTS) or tokens[i] in _EOG_ANY_TYPE]
        control = {tokens[i]: i for i, ty in enumerate(token_types) if ty == _CONTROL}
        eos = _with_harmony_stops(eos, control.get)
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=[i for i in eos if i is not None], add_bos=add_bos,
                   chat_template=chat_template, source=source)

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike) -> "Tokenizer":
        """Loads ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja`` /
        ``generation_config.json`` when present) from a Hugging Face model folder.

        EOS ids: ``tokenizer_config.eos_token`` then ``generation_config.eos_token_id`` (int or list;
        without it ``config.json``'s, as transformers' ``GenerationConfig.from_model_config`` takes it);
        a harmony vocabulary (gpt-oss) also stops at ``<|return|>`` and ``<|call|>``, not at ``<|end|>``.
        ``add_bos`` follows ``tokenizer_config.add_bos_token`` (default False).

        Raises:
          DFlashError: a missing or malformed ``tokenizer.json``; a special token named in the
            config that is not in the vocabulary.
        """
        from tokenizers import Tokenizer as HFTokenizer

        from dflash_jax.families.hf_config import read_json

        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise DFlashError(str(tj), "file not found", "a tokenizers JSON file")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise DFlashError(str(tj), f"not a valid tokenizer ({e})", "a tokenizers JSON file") from None
        cfg_path = folder / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.is_file() else {}
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
        if gen.get("eos_token_id") is None and (folder / "config.json").is_file():
            gen = read_json(folder / "config.json")

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            if value is None:
                return None
            i = tok.token_to_id(value)
            if i is None:
                raise DFlashError(f"{cfg_path}: field {key}", f"token {value!r} not in the vocabulary")
            return i

        eos = [token_id("eos_token")]
        g = gen.get("eos_token_id")
        eos = _with_harmony_stops(eos + (g if isinstance(g, list) else [g]), tok.token_to_id)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(tok, bos_token_id=token_id("bos_token"), eos_token_ids=[i for i in eos if i is not None],
                   add_bos=bool(cfg.get("add_bos_token", False)), chat_template=template, source=str(folder))

    # ------------------------------------------------------------------ use

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids. Special tokens written in ``text`` (``<|im_start|>``) are parsed to their ids.

        Args:
          text: any string.
          add_bos: prepend the BOS id; ``None`` follows the source's ``add_bos`` setting.
        Returns:
          ``list[int]``.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text (byte-level decoding; invalid UTF-8 becomes U+FFFD).

        Args:
          ids: token ids (ints or a 1-D integer array).
          skip_special_tokens: drop special (control) tokens from the output.
        """
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        """An incremental decoder of this tokenizer (special tokens skipped unless told): ``step(id)`` returns
        the text that id completes, each token decoded once (``tokenizers.decoders.DecodeStream``)."""
        return IncrementalDecoder(self._tok, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token text, or ``None``."""
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """Renders ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        ``bos_token``, ``eos_token``, ``add_generation_prompt`` and ``template_kwargs`` (for example
        ``enable_thinking=False``, ``tools``) are visible to the template.

        Returns:
          the prompt text (encode it with :meth:`encode_chat` or ``encode(text, add_bos=False)``).
        Raises:
          DFlashError: no chat template, or the template raised (``raise_exception``) or failed.
        """
        import jinja2
        from jinja2.sandbox import SecurityError

        if self._template is None:
            raise DFlashError(f"{self.source}: chat template", "missing", "a tokenizer with a chat template")
        ctx = dict(bos_token=self.bos_token, eos_token=self.eos_token)
        ctx.update(template_kwargs)
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **ctx)
        except DFlashError as e:
            if e.where != "chat template":
                raise
            # raise_exception(...) inside the template: name the file the template came from
            raise DFlashError(f"{self.source}: chat template", f"refused the messages: {e.what}",
                              "messages this template accepts (for example no --system, or other --chat-template-kwargs)") from None
        except SecurityError as e:
            raise DFlashError(f"{self.source}: chat template", f"blocked by the sandbox ({e})",
                              "a template that uses only what the jinja2 sandbox allows") from None
        except jinja2.TemplateError as e:
            raise DFlashError(f"{self.source}: chat template", f"failed to render ({e})",
                              "a template that renders these messages and --chat-template-kwargs") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        """Renders and encodes a chat; BOS is prepended only when the source's ``add_bos`` is set and
        the rendered text does not already start with the BOS token. Returns ``list[int]``."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        ids = self.encode(text, add_bos=False)
        if self.add_bos and not (ids and ids[0] == self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"
