"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model`` ``llama`` and ``gemma4``) as a
``tokenizers`` BPE model.

Such a vocabulary spells a space as ``▁`` (U+2581), keeps bytes the vocabulary lacks as
``<0xXX>`` tokens (byte fallback) and splits nothing before BPE. The tokenizer built here follows
transformers' GGUF integration (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``:
``LlamaTokenizer`` for ``llama``, ``GemmaTokenizer`` for ``gemma4``):

* merges: ``tokenizer.ggml.merges`` when the file has them (llama.cpp's converter writes them for
  ``gemma4`` and for Llama vocabularies read from a ``tokenizer.json``); otherwise they are derived
  from the vocabulary: every split of a token into two tokens of the vocabulary is a merge, ranked
  by the score of the token it makes (higher first; a SentencePiece BPE model's score is minus its
  merge rank), ties by the longer left then right piece, then by id;
* ``tokenizer.ggml.add_space_prefix`` (default ``True`` for ``llama``, ``False`` for ``gemma4``):
  a ``▁`` is put before the text unless it already starts with one (``Metaspace``'s ``first``
  scheme), and decoding drops one leading space;
* decoding: ``▁`` -> space, ``<0xXX>`` runs -> their UTF-8 text.
"""

from __future__ import annotations

from typing import Sequence
from dflash_jax.errors import DFlashError


SPM_MODELS = ("llama", "gemma4")
_SPACE = "\u2581"


def _parse_merges(merges: Sequence[str], vocab: dict, source: str) -> list[tuple[str, str]]:
    """``"left right"`` strings -> pairs, split at the first space after the first character (as
    llama.cpp's ``llama-vocab.cpp`` does, so a left piece may itself be a space); both pieces and
    their concatenation must be tokens of ``vocab``."""
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)
        if cut < 0 or cut == len(m) - 1:
            raise DFlashError(f"{source}: metadata tokenizer.ggml.merges", f"malformed merge {m!r}", "'left right'")
        left, right = m[:cut], m[cut + 1:]
        missing = [t for t in (left, right, left + right) if t not in vocab]
        if missing:
            raise DFlashError(f"{source}: metadata tokenizer.ggml.merges", f"merge {m!r} names {missing[0]!r}, not a token",
                              "merges of tokens in tokenizer.ggml.tokens")
        pairs.append((left, right))
    return pairs


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (the ranking ``generate_merges`` in
    transformers' ``tokenization_utils_base.py`` uses).

    Args:
      tokens: id -> token text.
      scores: id -> score (higher merges first).
    Returns:
      ``list[tuple[str, str]]``, highest priority first: every ``(left, right)`` with ``left``,
      ``right`` and ``left + right`` all in ``tokens``.
    """
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    found = []  # (score, len(left), len(right), order, left, right)
    for i, t in enumerate(tokens):
        if ids[t] != i:
            continue
        local = [(ids[t[:k]], ids[t[k:]], t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
        for li, ri, left, right in sorted(local):
            found.append((float(scores[i]), len(left), len(right), -len(found), left, right))
    found.sort(reverse=True)
    return [(left, right) for *_, left, right in found]


def spm_tokenizer(tokens: Sequence[str], scores: Sequence[float] | None, merges: Sequence[str] | None, *,
                  unk_token: str | None, add_space_prefix: bool, source: str):
    """A ``tokenizers.Tokenizer`` (BPE with byte fallback, ``▁`` for spaces) for a SentencePiece vocabulary.

    Args:
      tokens: id -> token text as the GGUF spells it (``"▁the"``, ``"<0x0A>"``).
      scores: ``tokenizer.ggml.scores`` (needed only without merges).
      merges: ``tokenizer.ggml.merges`` (``"left right"``), or ``None`` / empty to derive them.
      unk_token: the unknown token's text, or ``None``.
      add_space_prefix: put ``▁`` before a text that does not start with a space.
      source: the file, for messages.
    Returns:
      a ``tokenizers.Tokenizer`` without added tokens (the caller adds control / user-defined ones).
    Raises:
      DFlashError: duplicate tokens; a malformed merge or one naming a non-token; neither merges nor scores (naming the key);
        scores of another length than the tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise DFlashError(f"{source}: metadata tokenizer.ggml.tokens", f"token {t!r} appears twice (ids {vocab[t]}, {i})", "unique tokens")
        vocab[t] = i
    if merges:
        pairs = _parse_merges(merges, vocab, source)
    elif scores is None:
        raise DFlashError(f"{source}: metadata tokenizer.ggml.scores", "missing (and no tokenizer.ggml.merges)",
                          "token scores or merges for a SentencePiece vocabulary")
    elif len(scores) != len(tokens):
        raise DFlashError(f"{source}: metadata tokenizer.ggml.scores", f"{len(scores)} entries for {len(tokens)} tokens", "one per token")
    else:
        pairs = merges_from_scores(tokens, scores)
    unk = unk_token if unk_token in vocab else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok
