"""Test set-up: CPU, float32, quick compiles, a persistent compilation cache of this test session's own.

The cache lives in a fresh folder per session (inherited by the CLI and notebook subprocesses
through ``JAX_COMPILATION_CACHE_DIR``) and is removed at exit, so a test run is self-contained:
it neither reads nor fills the user's cache.

Compiling is most of the suite's time, so XLA:CPU compiles the tests' programs with LLVM's
optimizations off (:data:`QUICK_COMPILE`, as ``tools/gpu_check.py --dry-run`` does): the same HLO
programs (no fast-math either way) as unoptimized machine code, whose float results differ from the
optimized code's by rounding only (about 1e-6 relative on the tiny models' logits: what another CPU
changes too, and far inside every oracle's tolerance), and with XLA:CPU's older loop emitters
(:data:`LEGACY_EMITTERS`, where this jaxlib has them), which compile the same fused HLO in less than
half the CPU time. Subprocesses inherit it through ``XLA_FLAGS`` (:func:`xla_flags` for those that set the device count,
:func:`real_model_env` for those that run the real default model, whose programs the newer emitters compile faster).
"""

import atexit
import gc
import os
import shutil
import sys
import tempfile

import pytest

# DFLASH_JAX_REQUIRE_ORACLES=1: a test that a missing oracle would skip fails instead (tests/oracle_switch.py)
from oracle_switch import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's older loop emitters instead of its MLIR fusion emitters: the same fused HLO, compiled
# in less than half the CPU time (the Laguna prefill and decode loop of tools/gpu_check.py's dry
# run: 23.5 s -> 10.4 s of CPU, 2026-12-07); compiling is most of the suite's time.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows ``flag`` (an unknown one in ``XLA_FLAGS`` aborts every
    process): asked once per session in a subprocess, the answer kept in the environment for the
    pytest-xdist workers."""
    key = "DFLASH_JAX_TEST_XLA_ACCEPTS_" + flag.lstrip("-").split("=")[0].upper()
    if key not in os.environ:
        import subprocess
        import sys

        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flag)
        r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=300)
        os.environ[key] = "1" if r.returncode == 0 else "0"
    return os.environ[key] == "1"


QUICK_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if _xla_accepts(LEGACY_EMITTERS):
    QUICK_COMPILE += f" {LEGACY_EMITTERS}"


# XLA:CPU ends a process whose collective waits 40 s for a device thread (its default): with two
# test workers and a multi-device subprocess on two cores, a starved thread arrives later than
# that and the test dies ("Termination timeout ... exceeded"); waits of minutes are still no hang.
PATIENT_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                       "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` of a test process with ``devices`` CPU devices, compiling quickly
    (:data:`QUICK_COMPILE`), its collectives patient (:data:`PATIENT_COLLECTIVES`) when it has several."""
    patient = f" {PATIENT_COLLECTIVES}" if devices > 1 else ""
    return f"--xla_force_host_platform_device_count={devices} {QUICK_COMPILE}{patient}"


os.environ.setdefault("XLA_FLAGS", xla_flags(1))


def real_model_env() -> dict:
    """The environment of a subprocess that runs the real default model (SmolLM2-135M): this
    process's, its ``XLA_FLAGS`` without :data:`LEGACY_EMITTERS`. The legacy emitters compile the
    tiny models' programs (most of the suite) faster, but the 135M model's slower, and its code runs
    slower too: loading it and decoding 24 tokens plain and with DFlash on two prompts took 60 s
    and 70 s of CPU with them, 51 s and 53 s without them (at the same O0, each from a cold
    compile cache; the second prompt, warm: 2.5 s and 2.0 s; 2026-12-07)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(LEGACY_EMITTERS, "")
    return dict(os.environ, XLA_FLAGS=" ".join(flags.split()))


# the suite runs beside other jobs: a cost measurement is kept however busy the machine
# (tests/test_depth.py fakes a busy clock to test the check itself)
os.environ.setdefault("DFLASH_JAX_BUSY_SHARE", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jit_cache = tempfile.mkdtemp(prefix="dflash_jax_test_jit_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jit_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, _jit_cache, ignore_errors=True)

import jax  # noqa: E402
# absl's logging handler (flax and orbax import absl) closes its stream when that is not the
# sys.stderr of the moment, and uvicorn's logging set-up (an in-process `serve`, under capsys) closes
# every handler: it closed pytest's capture file, the stderr the handler was made with, and every
# later test of the worker failed. Pointed at the real stderr, it is never closed.
import absl.logging  # noqa: E402

absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__

jax.config.update("jax_default_matmul_precision", "highest")

from dflash_jax.nn import attention as live_attention  # noqa: E402

# Attention reads the live cache in blocks of KEY_BLOCK slots (256 in use). The tiny models here
# have capacities of 32-128 slots, so every oracle test (transformers, z-lab, llama.cpp,
# losslessness) runs with blocks of 16 and crosses block boundaries in prefill, decode, verify,
# rollback and the drafter context. tests/test_live_attention.py covers the production size.
live_attention.KEY_BLOCK = 16


def pytest_collection_modifyitems(config, items):
    """Files holding a ``slow`` test run first, each file's tests in their order: the two workers
    (``-n 2 --dist loadfile``) take files in this order, so the long ones (the GPU check's dry run,
    the notebook, the default model's) start early rather than leave one worker running alone at
    the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: a file's tests stay together, in order


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


# ---------------------------------------------------------------- the server tests' shared servers

SERVE_MAX_BATCH, SERVE_MAX_LEN = 8, 160


@pytest.fixture(scope="session")
def serve_tiny_model(tmp_path_factory):
    """``(hf folder, target, drafter)``: the tiny HF Llama with its byte tokenizer and a tiny random drafter."""
    import tiny_hf

    import dflash_jax as dj
    from dflash_jax.loading import Drafter
    from dflash_jax.testing import tiny_drafter

    folder = tiny_hf.make_tiny_hf(tmp_path_factory.mktemp("serve_tiny_hf"))
    target = dj.load_target(folder)
    cfg, params = tiny_drafter(target.cfg, seed=3, layer_ids=(0, 1), block_size=4)
    return folder, target, Drafter(cfg=cfg, params=params, source="tiny-drafter")


@pytest.fixture(scope="session")
def serve_tiny(serve_tiny_model):
    """A DFlash server of the tiny model on a free loopback port, shared by the server tests:
    ``(base url, engine)``; its model name is ``tiny``."""
    from serve_util import serve_in_thread

    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    _, target, drafter = serve_tiny_model
    engine = Engine(ServedModel(target, drafter, name="tiny"), max_batch=SERVE_MAX_BATCH, max_len=SERVE_MAX_LEN, max_queue=64)
    url, stop = serve_in_thread(build_app(engine, max_body_bytes=64 << 10))
    yield url, engine
    stop()


@pytest.fixture(scope="session")
def serve_scripted():
    """A plain-decoding server of the scripted model (tests/serve_util.py): ``(base url, engine)``."""
    from serve_util import scripted_target, serve_in_thread

    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    engine = Engine(ServedModel(scripted_target(), None, name="scripted"), max_batch=2, max_len=480)
    url, stop = serve_in_thread(build_app(engine))
    yield url, engine
    stop()


def run_on_cpu_devices(script: str, devices: int = 4, timeout: float = 900) -> str:
    """Runs ``script`` (``python -c``) from the repository root in a process with ``devices`` CPU
    devices; asserts that it exits 0 and prints ``OK``; returns its stdout."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "OK" in r.stdout
    return r.stdout
