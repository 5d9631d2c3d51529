"""The cache of a GGUF's tokenizer: ``<file>.gguf.tokenizer.json`` beside the file, keyed by its size
and mtime (:func:`dflash_jax.formats.files.cache_key`), so a later load skips the GGUF metadata."""

from __future__ import annotations

import json
import os
from pathlib import Path
from dflash_jax.formats.files import atomic_path, cache_key


_TOK_CACHE_FORMAT = "dflash_jax.gguf.tokenizer/3"  # 2: harmony stops; 3: qwen35 regex, SentencePiece vocabularies


def _tok_cache_path(path: str) -> Path:
    return Path(path + ".tokenizer.json")


def read_tok_cache(path: str) -> dict | None:
    """The cached tokenizer of GGUF ``path`` as :class:`~dflash_jax.formats.tokenizer.Tokenizer` keyword
    arguments (``tokenizer``, ``bos_token_id``, ``eos_token_ids``, ``add_bos``, ``chat_template``), or
    ``None`` when there is no cache, it is stale (another size / mtime / format) or unreadable (never raises)."""
    from tokenizers import Tokenizer as HFTokenizer


    cpath = _tok_cache_path(path)
    try:
        if not cpath.is_file() or not os.path.isfile(path):
            return None
        d = json.loads(cpath.read_text(encoding="utf-8"))
        if d.get("format") != _TOK_CACHE_FORMAT or d.get("source_key") != cache_key(path):
            return None
        return dict(tokenizer=HFTokenizer.from_str(d["tokenizer"]), bos_token_id=d["bos_token_id"], eos_token_ids=list(d["eos_token_ids"]),
                    add_bos=bool(d["add_bos"]), chat_template=d["chat_template"])
    except Exception:  # stale or damaged: rebuild
        return None


def write_tok_cache(path: str, tok) -> None:
    """Writes ``tok`` (a :class:`~dflash_jax.formats.tokenizer.Tokenizer`) as GGUF ``path``'s cache, atomically;
    an unwritable folder only prints a warning to stderr."""
    import sys


    cpath = _tok_cache_path(path)
    d = dict(format=_TOK_CACHE_FORMAT, source_key=cache_key(path), tokenizer=tok._tok.to_str(), bos_token_id=tok.bos_token_id,
             eos_token_ids=list(tok.eos_token_ids), add_bos=tok.add_bos, chat_template=tok.chat_template)
    try:
        with atomic_path(cpath) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(d, f, ensure_ascii=False)
    except OSError as e:
        print(f"dflash_jax: could not write the tokenizer cache {cpath} ({e})", file=sys.stderr)
