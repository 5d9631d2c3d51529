"""The store of compiled programs (dflash_jax.runtime.compiled): a program compiled in one process runs
from the store in the next without tracing, lowering or compiling; its key follows what decides
the program; bad entries and programs JAX read back from its own cache are never used from it."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.runtime import compiled as executables
from dflash_jax.runtime.compiled import count_compilations, count_store_reads
from dflash_jax.nn import attention as live_attention
from dflash_jax.decode.prefill import FEW_ROWS_OPTIONS


@jax.jit
def _loop(x, w):
    def body(c):
        i, x = c
        return i + 1, jnp.tanh(x @ w) + jnp.arange(x.shape[-1], dtype=x.dtype) * i

    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]


@pytest.fixture
def store(tmp_path):
    """A compile cache folder of this test's own (the store lives inside it)."""
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / "executables"
    jax.config.update("jax_compilation_cache_dir", old)


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp
    import dflash_jax
    from dflash_jax.decode import loop as decode
    from dflash_jax.runtime import compiled as executables
    from dflash_jax.runtime.compiled import count_compilations, count_store_reads
    from dflash_jax.decode.state import Decoding, Params
    from dflash_jax.testing import tiny_target
    cfg, params = tiny_target("llama", seed=3)
    static = Decoding(cfg)
    state = decode.prefill(Params(params), decode.init_state(static, [[5, 9, 17]], 32, 6), static, 8)
    with count_compilations() as compiled, count_store_reads() as read:
        loop = executables.compile(decode.generate_until, Params(params), state, static, jnp.int32(1))
        out = loop(Params(params), state, jnp.int32(1))
    print(json.dumps(dict(compiled=compiled(), read=read(), tokens=jax.device_get(out.tokens[0, :out.length[0]]).tolist())))
""")


def test_a_stored_decode_loop_runs_in_a_new_process_without_compiling(tmp_path):
    """The first process compiles and stores the loop; the second reads it, compiles nothing and
    decodes the same tokens."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    runs = [json.loads(subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True,
                                      timeout=600).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["compiled"] >= 1 and runs[0]["read"] == 0
    assert runs[1]["compiled"] == 0 and runs[1]["read"] == 1
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert len(list((tmp_path / "executables").glob("generate_until-*.bin"))) == 1


def test_the_key_follows_shapes_statics_and_trace_constants(monkeypatch):
    x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
    k = executables.key(_loop, (x, w))
    assert k == executables.key(_loop, (x + 1, w * 2))  # values are not part of it
    assert k != executables.key(_loop, (jnp.ones((3, 4)), w))
    assert k != executables.key(_loop, (x.astype(jnp.bfloat16), w))
    assert executables.key(_loop, (x, w, 7)) != executables.key(_loop, (x, w, 8))  # a static argument
    monkeypatch.setattr(live_attention, "KEY_BLOCK", live_attention.KEY_BLOCK + 1)
    assert k != executables.key(_loop, (x, w))


def test_an_argument_of_ambiguous_repr_is_never_keyed():
    class Opaque:
        pass

    assert executables.key(_loop, (jnp.ones(2), Opaque())) is None
    assert executables.key(_loop, (jnp.ones(2), np.arange(5000))) is not None  # an array: by its shape


def test_a_broken_entry_is_compiled_again(store):
    x, w = jnp.ones((2, 4)), jnp.eye(4)
    want = _loop(x, w)
    executables.compile(_loop, x, w)
    (entry,) = store.glob("*.bin")
    entry.write_bytes(b"not a pickle")
    jax.clear_caches()
    np.testing.assert_allclose(executables.compile(_loop, x, w)(x, w), want)
    assert entry.read_bytes() != b"not a pickle"


def test_a_lost_entry_is_stored_again_and_one_read_back_from_jax_cache_is_not(store):
    """JAX's cache keeps nothing the store compiled, so a lost entry (another version of the
    package, an eviction) is compiled and stored again; an executable JAX does read back from its
    cache (an entry written outside the store) is used but not stored."""
    x, w = jnp.ones((2, 3)), jnp.eye(3)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        executables.compile(_loop, x, w)
        (entry,) = store.glob("*.bin")
        entry.unlink()
        jax.clear_caches()
        executables.compile(_loop, x, w)
        assert entry.is_file()
        entry.unlink()
        jax.clear_caches()
        _loop.lower(x, w).compile(compiler_options=executables.FRESH)  # JAX keeps this one
        jax.clear_caches()
        with count_compilations() as compiled:
            out = executables.compile(_loop, x, w)(x, w)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))
    assert compiled() == 1  # a read from JAX's cache
    np.testing.assert_allclose(out, _loop(x, w))
    assert not entry.exists()


def test_the_store_keeps_the_most_recently_used_entries(tmp_path):
    for i, size in enumerate([300, 300, 300]):
        p = tmp_path / f"e{i}.bin"
        p.write_bytes(b"x" * size)
        os.utime(p, (1000 + i, 1000 + i))
    executables._trim(tmp_path, max_bytes=650)
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["e1.bin", "e2.bin"]


@jax.jit
def _project(x, w):
    return jnp.tanh(x @ w) @ w.T


def test_compiler_options_reach_xla_and_key_the_entry(store):
    """A program compiled with options (the short prefill's: no YNNPACK fusions) is another entry
    than the one without, and the options are in the executable read back from the store."""
    x, w = jnp.ones((64, 576)), jnp.full((576, 1536), 1e-3)
    plain = executables.compile(_project, x, w)
    few = executables.compile(_project, x, w, options=FEW_ROWS_OPTIONS)
    assert len(list(store.glob("_project-*.bin"))) == 2
    assert "ynn_fusion" in plain.as_text() and "ynn_fusion" not in few.as_text()
    jax.clear_caches()
    with count_compilations() as compiled, count_store_reads() as read:
        again = executables.compile(_project, x, w, options=FEW_ROWS_OPTIONS)
    assert (compiled(), read()) == (0, 1) and "ynn_fusion" not in again.as_text()
    np.testing.assert_allclose(again(x, w), plain(x, w), rtol=1e-5)



PLAIN_SCRIPT = textwrap.dedent("""
    import json, sys
    import dflash_jax as dj
    from dflash_jax.runtime.compiled import count_cache_hits, count_compilations, count_store_reads
    from dflash_jax.testing import tiny_target
    dj.enable_compile_cache()
    cfg, params = tiny_target("llama", seed=3)
    tiny = dj.Target(cfg=cfg, params=params, tokenizer=None, source="tiny", eos_ids=())
    streaming = sys.argv[1] == "stream"
    with count_compilations() as compiled, count_cache_hits() as hits, count_store_reads() as read:
        res = dj.generate(tiny, [[5, 9, 17]], max_new_tokens=4, chunk_size=8, on_tokens=(lambda t: None) if streaming else None)
    # compiled() counts JAX cache hits too (small eager programs): fresh compiles only
    print(json.dumps(dict(compiled=compiled() - hits(), read=read(), tokens=res.output_ids)))
""")


@pytest.mark.parametrize("mode", ["loop", "stream"])
def test_plain_generate_reads_every_program_back_in_a_new_process(tmp_path, mode):
    """Plain decoding (the whole loop, or the streamed step), each program compiled beside the
    prefill's in another thread, compiles nothing in a later process. A JAX cache hit in the
    prefill's thread (a small eager program such as ``jnp.zeros``, cached by an earlier process)
    once kept the decode program out of the store, so every warm ``dflash-jax generate --no-spec``
    compiled it again: the second run here starts with JAX's cache warm and the store empty."""
    env = dict(os.environ, DFLASH_JAX_CACHE=str(tmp_path))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("DFLASH_JAX_NO_COMPILE_CACHE", None)

    def run():
        out = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT, mode], env=env, capture_output=True, text=True, check=True, timeout=600)
        return json.loads(out.stdout.splitlines()[-1])

    first = run()
    shutil.rmtree(tmp_path / "jax_cache" / "executables")  # JAX's cache keeps the small programs
    second, third = run(), run()
    assert first["compiled"] >= 1 and second["compiled"] >= 1
    assert third["compiled"] == 0 and third["read"] == 3, third  # prefill chunk, finish prefill, decode
    assert first["tokens"] == second["tokens"] == third["tokens"]
