"""dflash_jax: DFlash speculative decoding in pure-functional JAX.

Public API (see :mod:`dflash_jax`)::

    import dflash_jax as dj
    target = dj.load_target()                       # embedded default, or an HF folder / .gguf
    drafter = dj.shipped_drafter(target)            # or dj.load_drafter(path, target); None: plain
    res = dj.generate(target, [dj.encode_prompt(target, "Hi!")], max_new_tokens=32, drafter=drafter)

Importing the package turns on JAX's persistent compilation cache in
``<cache folder>/jax_cache`` (cache folder: ``$DFLASH_JAX_CACHE``, else
``$XDG_CACHE_HOME/dflash_jax``, else ``~/.cache/dflash_jax``), so a second run does not compile
again. It is left alone when ``JAX_COMPILATION_CACHE_DIR`` is set (JAX then uses that folder)
and skipped when ``DFLASH_JAX_NO_COMPILE_CACHE=1``.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def compile_cache_dir():
    """The folder of the persistent compilation cache: ``<cache folder>/jax_cache``."""
    from dflash_jax.assets.default_model import cache_dir

    return cache_dir() / "jax_cache"


def _enable_compile_cache() -> None:
    if os.environ.get("DFLASH_JAX_NO_COMPILE_CACHE", "") not in ("", "0") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    try:
        if jax.config.jax_compilation_cache_dir:  # set by the user in code before importing us
            return
        jax.config.update("jax_compilation_cache_dir", str(compile_cache_dir()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    except Exception:  # an older or newer JAX without these options: run without the cache
        pass


_enable_compile_cache()

from dflash_jax.loading import Drafter, Target, load_drafter, load_target, shipped_drafter
from dflash_jax.driver import GenerationResult, generate
from dflash_jax.text import TextStream, encode_prompt
from dflash_jax.errors import DFlashError  # noqa: E402
from dflash_jax.decode.sampling import SamplingConfig  # noqa: E402

__all__ = [
    "DFlashError",
    "Drafter",
    "GenerationResult",
    "SamplingConfig",
    "Target",
    "TextStream",
    "compile_cache_dir",
    "encode_prompt",
    "generate",
    "load_drafter",
    "load_target",
    "shipped_drafter",
]
