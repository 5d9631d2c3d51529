"""Counting XLA compilations, to prove a warmed-up generation compiles nothing, and to say how
many programs a run compiled and how many of them the persistent compile cache held."""

from __future__ import annotations

import contextlib

from jax import monitoring

_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_STORE_READ = "store_read"  # a program read back from dflash_jax.executables' store (not a compile)
_counts = {_COMPILE: 0, _CACHE_HIT: 0, _STORE_READ: 0}
_registered = [False]


def _on_duration(name, duration, **kwargs):
    if name == _COMPILE:
        _counts[_COMPILE] += 1


def _on_event(name, **kwargs):
    if name == _CACHE_HIT:
        _counts[_CACHE_HIT] += 1


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


def note_store_read() -> None:
    """Counts one program read back from :mod:`dflash_jax.executables`' store."""
    _counts[_STORE_READ] += 1


@contextlib.contextmanager
def count_store_reads():
    """Context manager yielding a callable that returns how many programs were read back from
    :mod:`dflash_jax.executables`' store since the block began (they are not compilations)."""
    start = _counts[_STORE_READ]
    yield lambda: _counts[_STORE_READ] - start


def compilations() -> int:
    """XLA backend compilations in this process since counting began (the first call of a
    function of this module), persistent-cache hits included: a long-running process (the
    server) exposes it, since every new program stalls whatever waits for it."""
    _register()
    return _counts[_COMPILE]
