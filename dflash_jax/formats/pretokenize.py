"""Pre-tokenizers of GGUF byte-level BPE vocabularies, chosen by ``tokenizer.ggml.pre`` the way
llama.cpp's ``llama-vocab.cpp`` chooses them (``smollm``/``starcoder``: single digits, then the
GPT-2 regex; ``gpt2``: the GPT-2 regex; ``llama-bpe``; ``qwen2``; ``qwen35``; ``gpt-4o``: tiktoken's o200k pattern)."""

from __future__ import annotations

from dflash_jax.errors import DFlashError


_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 (llama.cpp's "qwen35"; transformers' qwen3_5 PRETOKENIZE_REGEX): Qwen2's, but combining marks (\p{M}) continue a word
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_C = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"  # o200k (tiktoken's gpt-4o pattern; llama.cpp's "gpt-4o" pre-type: gpt-oss)
_GPT4O_REGEX = (rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+{_C}|"
                rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*{_C}|"
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_PRE_GPT2 = ("gpt2", "gpt-2", "default", "olmo", "jais", "mpt", "gpt-neox")
_PRE_LLAMA3 = ("llama-bpe", "llama3", "smaug-bpe", "falcon3", "pixtral")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen")


def pre_tokenizer(pre: str | None, where: str):
    """The ``tokenizers`` pre-tokenizer for ``tokenizer.ggml.pre`` value ``pre`` (``None``: ``default``).

    Raises:
      DFlashError: an unknown ``pre`` (naming ``where``'s ``tokenizer.ggml.pre`` and the known values).
    """
    from tokenizers import Regex, pre_tokenizers

    pre = pre or "default"
    if pre in _PRE_DIGITS:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex = {**dict.fromkeys(_PRE_LLAMA3, _LLAMA3_REGEX), **dict.fromkeys(_PRE_QWEN2, _QWEN2_REGEX), "qwen35": _QWEN35_REGEX,
             "gpt-4o": _GPT4O_REGEX}.get(pre)
    if regex is None:
        known = sorted(_PRE_DIGITS + _PRE_GPT2 + _PRE_LLAMA3 + _PRE_QWEN2 + ("qwen35", "gpt-4o"))
        raise DFlashError(f"{where}: metadata tokenizer.ggml.pre", f"unsupported pre-tokenizer {pre!r}", f"one of {known}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
