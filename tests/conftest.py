"""Test set-up: CPU, float32, a persistent compilation cache shared by all tests of this run.

The cache lives in a fresh folder per test session (inherited by the CLI and notebook
subprocesses through ``JAX_COMPILATION_CACHE_DIR``), never in the user's cache: a test run then
never loads executables written by another process, such as a training job running meanwhile
(XLA:CPU once aborted while deserialising one under such concurrent use).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jit_cache = tempfile.mkdtemp(prefix="dflash_jax_test_jit_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jit_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, _jit_cache, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
