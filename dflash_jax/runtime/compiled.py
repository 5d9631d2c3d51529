"""Compiled programs: kept on disk under a key known before tracing, so a warm process neither
traces nor lowers them; XLA compilations counted, to prove a warmed-up generation compiles nothing
and to say how many programs a run compiled and how many of them the persistent compile cache
held; and that cache turned on (:func:`enable_compile_cache`).

JAX's persistent compilation cache (``<cache folder>/jax_cache``) is keyed by the lowered
program: to find an executable, a new process first traces and lowers the function, which for
the decode loop of a 30-layer target takes seconds on a CPU (BENCHMARKS.md, "The cost of auto at
the point of use"). :func:`compile` keys an executable instead by everything that decides it
before tracing:

* the function (module and qualified name) and the ``repr`` of each argument that is not an array
  (static configs; their reprs list every field);
* the tree structure of the arguments and each array's shape, dtype, weak type and sharding;
* the source of this package (a hash of every ``.py`` file under ``dflash_jax/``: any change of
  the code is a new key);
* the module constants read while tracing (:data:`TRACE_CONSTANTS`: the attention's key block,
  the weight layouts' row thresholds; a new such constant must be listed there);
* JAX's and jaxlib's versions, the backend's platform and version, the devices' kinds and count,
  ``XLA_FLAGS`` and the JAX options that change lowering (x64, matmul precision).

An entry is :func:`jax.experimental.serialize_executable.serialize`'s payload and trees, pickled,
in ``executables/<name>-<key>.bin`` inside JAX's persistent compilation cache folder, written
atomically: the store is on exactly when that cache is (``<cache folder>/jax_cache`` once
:func:`enable_compile_cache` ran, as :func:`dflash_jax.load_target` and the command line do). A
miss compiles the program anew, never from JAX's cache (see :data:`FRESH`). An entry that fails
to load (written by another JAX, truncated) is removed and the function compiled again; an argument whose ``repr`` could be ambiguous (a memory address, a
shortened array) is never keyed. Reading an entry runs what it holds, as JAX's own cache does: the folder
must be as trusted as the code. The store keeps at most :data:`MAX_BYTES`, dropping the least
recently used entries. Reading an executable back is what remains of a warm compile: on XLA:CPU
its time grows faster than its kernel count (BENCHMARKS.md), so programs with fewer target
passes load faster.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax import monitoring

_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_STORE_READ = "store_read"  # a program read back from dflash_jax.runtime.compiled' store (not a compile)
_counts = {_COMPILE: 0, _CACHE_HIT: 0, _STORE_READ: 0}
_registered = [False]
_thread = threading.local()  # this thread's persistent-cache hits (JAX reports them in the compiling thread)


def _on_duration(name, duration, **kwargs):
    if name == _COMPILE:
        _counts[_COMPILE] += 1


def _on_event(name, **kwargs):
    if name == _CACHE_HIT:
        _counts[_CACHE_HIT] += 1
        _thread.hits = getattr(_thread, "hits", 0) + 1


def _register() -> None:
    if not _registered[0]:
        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _registered[0] = True


@contextlib.contextmanager
def count_compilations():
    """Context manager yielding a callable that returns the XLA backend compilations so far.

    Counts every backend compile in the process while the block runs (persistent-cache hits
    included, since they still go through the backend compile step's timer).
    """
    _register()
    start = _counts[_COMPILE]
    yield lambda: _counts[_COMPILE] - start


@contextlib.contextmanager
def count_cache_hits():
    """Context manager yielding a callable that returns how many compilations since the block
    began were read from JAX's persistent compilation cache."""
    _register()
    start = _counts[_CACHE_HIT]
    yield lambda: _counts[_CACHE_HIT] - start


@contextlib.contextmanager
def _count_own_cache_hits():
    """Like :func:`count_cache_hits`, counting this thread's hits only: a program compiled beside
    another (the driver compiles prefill and decode side by side) must not take the other's
    cache hits (small eager programs such as ``jnp.zeros``) for its own."""
    _register()
    start = getattr(_thread, "hits", 0)
    yield lambda: getattr(_thread, "hits", 0) - start


def note_store_read() -> None:
    """Counts one program read back from :mod:`dflash_jax.runtime.compiled`' store."""
    _counts[_STORE_READ] += 1


@contextlib.contextmanager
def count_store_reads():
    """Context manager yielding a callable that returns how many programs were read back from
    :mod:`dflash_jax.runtime.compiled`' store since the block began (they are not compilations)."""
    start = _counts[_STORE_READ]
    yield lambda: _counts[_STORE_READ] - start


def compilations() -> int:
    """XLA backend compilations in this process since counting began (the first call of a
    function of this module), persistent-cache hits included: a long-running process (the
    server) exposes it, since every new program stalls whatever waits for it."""
    _register()
    return _counts[_COMPILE]

FORMAT = 1
# An executable that JAX read back from its own cache does not serialize whole again (its kernels
# are left out: "Function call_kernel not found" when the copy runs). So a program compiled for the
# store gets a key of its own in JAX's cache (this XLA option at its default value) and JAX does
# not keep it (the store does): every miss here compiles anew. One read back from JAX's cache all
# the same (an entry of another version of this module) is used but never stored.
FRESH = {"xla_cpu_enable_fast_math": False}
MAX_BYTES = 1 << 30  # 1 GiB: about 150 decode loops of the default pair
_AMBIGUOUS = (" at 0x", "...")
TRACE_CONSTANTS = (("dflash_jax.nn.attention", "KEY_BLOCK"), ("dflash_jax.nn.attention", "FLAT_MAX_QUERIES"),
                   ("dflash_jax.nn.params", "GATE_UP_MIN_ROWS"), ("dflash_jax.nn.params", "HEAD_MIN_ROWS"))


def compile_cache_dir() -> Path:
    """The folder of the persistent compilation cache: ``<cache folder>/jax_cache`` (cache folder:
    ``$DFLASH_JAX_CACHE``, else ``$XDG_CACHE_HOME/dflash_jax``, else ``~/.cache/dflash_jax``)."""
    from dflash_jax.assets.default_model import cache_dir

    return cache_dir() / "jax_cache"


def enable_compile_cache() -> str | None:
    """Turns on JAX's persistent compilation cache in :func:`compile_cache_dir` (entries kept
    however short their compile), so a second process does not compile again; with it the store of
    :func:`compile` (``executables/`` inside it). :func:`dflash_jax.load_target` and the
    ``dflash-jax`` command call it; importing the package does not change JAX's configuration.

    Leaves JAX's configuration alone when ``DFLASH_JAX_NO_COMPILE_CACHE`` is set (not ``0``), when
    ``JAX_COMPILATION_CACHE_DIR`` is set (JAX then uses that folder) or when the program already
    set ``jax_compilation_cache_dir``, and on a JAX without these options. Calling it again
    changes nothing.

    Returns:
      the cache folder JAX uses now (``str``), or ``None`` while the cache is off.
    """
    if os.environ.get("DFLASH_JAX_NO_COMPILE_CACHE", "") not in ("", "0") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return getattr(jax.config, "jax_compilation_cache_dir", None) or None
    try:
        if not jax.config.jax_compilation_cache_dir:  # set by the program itself: its folder stays
            jax.config.update("jax_compilation_cache_dir", str(compile_cache_dir()))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        return jax.config.jax_compilation_cache_dir
    except Exception:  # an older or newer JAX without these options: run without the cache
        return None


def store_dir() -> Path | None:
    """``executables/`` in JAX's persistent compilation cache folder, ``None`` while that cache is off."""
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / "executables" if folder else None


@functools.cache
def source_hash() -> str:
    """SHA-256 over the path and bytes of every ``.py`` file of the package, in path order."""
    root = Path(__file__).resolve().parent.parent  # the package folder (this file is runtime/compiled.py)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _platform() -> tuple:
    import jaxlib

    devices = jax.devices()
    backend = devices[0].client
    cfg = jax.config
    constants = tuple(getattr(importlib.import_module(m), name) for m, name in TRACE_CONSTANTS)
    return (FORMAT, constants, jax.__version__, jaxlib.__version__, backend.platform, backend.platform_version,
            tuple(d.device_kind for d in devices), os.environ.get("XLA_FLAGS", ""),
            cfg.jax_enable_x64, str(cfg.jax_default_matmul_precision), source_hash())


def _leaf_key(x) -> str | None:
    """An array's aval and sharding, or a static value's ``repr``; ``None`` when that repr could
    stand for more than one value."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        weak = getattr(getattr(x, "aval", None), "weak_type", False)
        return f"{x.dtype}{list(x.shape)}w{int(weak)}:{getattr(x, 'sharding', None)}"
    r = repr(x)
    return None if any(a in r for a in _AMBIGUOUS) else f"{type(x).__qualname__}={r}"


def key(fn: Callable, args: tuple) -> str | None:
    """The store's key of ``fn(*args)`` (hex SHA-256), or ``None`` when an argument cannot be keyed."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    parts = [_leaf_key(x) for x in leaves]
    if None in parts:
        return None
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    text = repr((_platform(), name, str(treedef), parts))
    return hashlib.sha256(text.encode()).hexdigest()


def _path(folder: Path, fn: Callable, k: str) -> Path:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in getattr(fn, "__name__", "fn"))
    return folder / f"{name}-{k[:40]}.bin"


def _load(path: Path) -> Any | None:
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        fmt, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        if fmt != FORMAT:  # not bad input: an entry of another version of this module, handled
            raise ValueError(f"format {fmt}")  # below like any unreadable entry (never reaches a caller)
        compiled = deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception:  # written by another JAX or truncated: compile again
        path.unlink(missing_ok=True)
        return None
    os.utime(path)  # recently used
    note_store_read()
    return compiled


def _save(path: Path, compiled) -> None:
    from jax.experimental.serialize_executable import serialize

    try:
        payload, in_tree, out_tree = serialize(compiled)
        data = pickle.dumps((FORMAT, payload, in_tree, out_tree))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        _trim(path.parent)
    except (OSError, ValueError, NotImplementedError, pickle.PicklingError):
        return  # a read-only cache folder or a program JAX cannot serialize: keep it in memory only


def _trim(folder: Path, max_bytes: int | None = None) -> None:
    """Drops the least recently used entries of ``folder`` beyond ``max_bytes`` (default :data:`MAX_BYTES`)."""
    limit = MAX_BYTES if max_bytes is None else max_bytes
    entries = sorted(folder.glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for p in entries:
        total += p.stat().st_size
        if total > limit:
            p.unlink(missing_ok=True)


def _not_kept_by_jax():
    """A context (this thread) in which JAX's persistent cache keeps no new entry."""
    from jax._src import config

    return config.persistent_cache_min_compile_time_secs(float("inf"))


def compile(fn, *args, options: dict | None = None):
    """``fn.lower(*args).compile(compiler_options=options)``, read from the store when this
    process's key is there.

    Args:
      fn: a ``jax.jit``-wrapped function; ``args`` its positional arguments, static ones
        included, exactly as ``fn.lower`` takes them.
      options: XLA compiler options of this program (part of its key), e.g.
        :data:`dflash_jax.decode.prefill.FEW_ROWS_OPTIONS`.
    Returns:
      a :class:`jax.stages.Compiled`, called with the non-static arguments.
    Raises:
      whatever ``fn.lower`` or ``compile`` raise for these arguments (a program read from the
      store was compiled from the same source, shapes and settings, so it raises nothing new).
    """
    options = dict(options or {})
    folder = store_dir()
    k = key(fn, args + (sorted(options.items()),)) if folder is not None else None
    if k is not None:
        path = _path(folder, fn, k)
        compiled = _load(path)
        if compiled is not None:
            return _on_mesh(compiled)
    if k is None:
        return _on_mesh(fn.lower(*args).compile(compiler_options=options or None))
    with _count_own_cache_hits() as hits, _not_kept_by_jax():
        compiled = fn.lower(*args).compile(compiler_options={**FRESH, **options})
    if hits() == 0:
        _save(path, compiled)
    return _on_mesh(compiled)


def _on_mesh(compiled):
    """``compiled``, or on a device mesh a function that first moves each array argument to the
    sharding the program was compiled for: a program's outputs (the state after a prefill chunk)
    may come laid out otherwise than the next program's inputs were when it was compiled, and a
    compiled program, unlike ``jax.jit``, takes its own shardings only. (The function must keep
    its unused arguments, ``jax.jit(..., keep_unused=True)``: the shardings then name every one.)"""
    want = compiled.input_shardings[0]
    if all(len(sh.device_set) == 1 for sh in jax.tree_util.tree_leaves(want)):
        return compiled

    def call(*args):
        moved = [x if _placed_as(x, sh) else jax.device_put(x, sh) for x, sh in zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(want))]
        return compiled(*jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), moved))

    return call


def _placed_as(x, sharding) -> bool:
    """Whether ``x`` is laid out as ``sharding`` says (PRNG key arrays, whose compiled sharding
    describes their key data, are left as they are)."""
    if not hasattr(x, "sharding") or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return True
    return x.sharding.is_equivalent_to(sharding, x.ndim)
