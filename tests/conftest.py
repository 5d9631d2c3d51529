"""Test set-up: CPU, float32, a persistent compilation cache of this test session's own.

The cache lives in a fresh folder per session (inherited by the CLI and notebook subprocesses
through ``JAX_COMPILATION_CACHE_DIR``) and is removed at exit, so a test run is self-contained:
it neither reads nor fills the user's cache.
"""

import atexit
import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jit_cache = tempfile.mkdtemp(prefix="dflash_jax_test_jit_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jit_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, _jit_cache, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from dflash_jax.nn import live_attention  # noqa: E402

# Attention reads the live cache in blocks of KEY_BLOCK slots (256 in use). The tiny models here
# have capacities of 32-128 slots, so every oracle test (transformers, z-lab, llama.cpp,
# losslessness) runs with blocks of 16 and crosses block boundaries in prefill, decode, verify,
# rollback and the drafter context. tests/test_live_attention.py covers the production size.
live_attention.KEY_BLOCK = 16


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    Every XLA:CPU executable keeps memory mappings of its own; a whole-suite run in one process
    otherwise reaches the kernel's per-process mapping limit (``vm.max_map_count``, 65530 by
    default) and LLVM aborts with "Cannot allocate memory" late in the run.
    """
    yield
    from dflash_jax import driver

    driver._COMPILED.clear()
    jax.clear_caches()
    gc.collect()
