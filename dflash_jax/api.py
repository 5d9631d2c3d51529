"""The documented Python API: load a target (and a drafter), encode a prompt, generate.

Typical use::

    import dflash_jax as dj

    target = dj.load_target()                      # embedded SmolLM2-135M-Instruct (float32)
    ids = dj.encode_prompt(target, "What is 2 + 2?")   # chat template applied
    res = dj.generate(target, [ids], max_new_tokens=64)                      # plain decoding
    res = dj.generate(target, [ids], max_new_tokens=64, drafter=dj.shipped_drafter(target))  # DFlash
    print(target.tokenizer.decode(res.output_ids[0], skip_special_tokens=True))
    print(res.stats)

This module only gathers the public names; each lives in the module that does its job:
:mod:`dflash_jax.loading` (targets and drafters), :mod:`dflash_jax.text` (prompts, stop texts,
streaming text), :mod:`dflash_jax.driver` (:func:`generate`, the timed driver),
:mod:`dflash_jax.arguments` (its argument checks and defaults) and :mod:`dflash_jax.results`
(:class:`GenerationResult`). Lower-level pieces (decode state, prefill, decode or DFlash step,
on-device loop, continuous batching) live in :mod:`dflash_jax.decode`; :func:`generate` is a thin,
timed driver over them. Every step is compiled ahead of time
(``jax.jit(...).lower(...).compile()``) before the clock starts, so the reported times exclude
compilation (which the persistent compilation cache makes cheap on a second run).

Stop strings (``stop=``): a stop text that encodes to exactly one token id becomes a stop id and
ends its row on device, like EOS. A longer stop text is checked on the decoded text: when
streaming (``on_tokens`` given) a row stops at the step whose text first contains it; without
streaming decoding continues on device and the output is cut afterwards. Either way (one token or
several) the row's ``output_ids`` end with the token that completed the first stop text in the
decoded output, ``texts`` end just before that stop text, and ``finish_reason`` is ``"stop"``.
"""

from __future__ import annotations

from dflash_jax.arguments import default_max_len, effective_chunk_size
from dflash_jax.driver import generate
from dflash_jax.loading import (
    DTYPES,
    LAYER_LAYOUTS,
    Drafter,
    Target,
    load_drafter,
    load_target,
    shipped_drafter,
    with_output_head,
)
from dflash_jax.errors import DFlashError
from dflash_jax.results import GenerationResult, build_result, spec_stats
from dflash_jax.sampling import SamplingConfig
from dflash_jax.text import TextStream, encode_prompt, split_stop

__all__ = [
    "DFlashError",
    "DTYPES",
    "LAYER_LAYOUTS",
    "Drafter",
    "GenerationResult",
    "SamplingConfig",
    "Target",
    "TextStream",
    "build_result",
    "default_max_len",
    "effective_chunk_size",
    "encode_prompt",
    "generate",
    "load_drafter",
    "load_target",
    "shipped_drafter",
    "spec_stats",
    "split_stop",
    "with_output_head",
]
