"""Counting XLA compilations, to prove a warmed-up generation compiles nothing."""

from __future__ import annotations

import contextlib

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_count = [0]
_registered = [False]


def _listener(name, duration, **kwargs):
    if name == _EVENT:
        _count[0] += 1


@contextlib.contextmanager
def count_compilations():
    """Context manager yielding a callable that returns the XLA backend compilations so far.

    Counts every backend compile in the process while the block runs (persistent-cache hits
    included, since they still go through the backend compile step's timer).
    """
    if not _registered[0]:
        monitoring.register_event_duration_secs_listener(_listener)
        _registered[0] = True
    start = _count[0]
    yield lambda: _count[0] - start
