"""dflash_jax: DFlash speculative decoding in pure-functional JAX.

The public API (the guide: docs/python_api.md)::

    import dflash_jax as dj
    target = dj.load_target()                       # embedded default, or an HF folder / .gguf
    drafter = dj.shipped_drafter(target)            # or dj.load_drafter(path, target); None: plain
    res = dj.generate(target, [dj.encode_prompt(target, "Hi!")], max_new_tokens=32, drafter=drafter)

Importing the package changes none of JAX's configuration. :func:`load_target` (and so the
``dflash-jax`` command, which also calls it first thing) turns on JAX's persistent compilation
cache through :func:`enable_compile_cache`: in ``<cache folder>/jax_cache`` (cache folder:
``$DFLASH_JAX_CACHE``, else ``$XDG_CACHE_HOME/dflash_jax``, else ``~/.cache/dflash_jax``), so a
second run does not compile again. It is left alone when ``JAX_COMPILATION_CACHE_DIR`` is set
(JAX then uses that folder), when the program set ``jax_compilation_cache_dir`` itself, and
skipped when ``DFLASH_JAX_NO_COMPILE_CACHE=1``. Call ``dflash_jax.enable_compile_cache()`` to have
it before (or without) loading a target.
"""

from __future__ import annotations

__version__ = "0.1.0"

from dflash_jax.loading import Drafter, Target, load_drafter, load_target, shipped_drafter
from dflash_jax.driver import GenerationResult, generate
from dflash_jax.text import TextStream, encode_prompt
from dflash_jax.errors import DFlashError
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.runtime.compiled import compile_cache_dir, enable_compile_cache

__all__ = [
    "DFlashError",
    "Drafter",
    "GenerationResult",
    "SamplingConfig",
    "Target",
    "TextStream",
    "compile_cache_dir",
    "enable_compile_cache",
    "encode_prompt",
    "generate",
    "load_drafter",
    "load_target",
    "shipped_drafter",
]
