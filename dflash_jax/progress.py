"""Progress lines on stderr: what is happening and how long it took (``dflash_jax: ...``).

The slow steps of a first run (download, dequantization, writing the float32 cache) are always
reported, so a first run is never minutes of silence. Routine steps (loading weights, compiling
or reading compiled programs from the compile cache) are reported only after :func:`verbose`
(the command line turns it on when stderr is a terminal; the Python API stays quiet).
``DFLASH_JAX_PROGRESS=1`` reports every step, ``DFLASH_JAX_PROGRESS=0`` none.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator


_VERBOSE = [False]


def verbose(on: bool = True) -> None:
    """Also report routine steps (loading weights, compiling); ``dflash-jax generate`` calls it."""
    _VERBOSE[0] = bool(on)


def _shown(routine: bool) -> bool:
    env = os.environ.get("DFLASH_JAX_PROGRESS", "")
    if env in ("0", "1"):
        return env == "1"
    return not routine or _VERBOSE[0]


def note(message: str, routine: bool = False) -> None:
    """Prints ``dflash_jax: <message>`` to stderr (a ``routine`` note only after :func:`verbose`;
    ``DFLASH_JAX_PROGRESS`` overrides both)."""
    if _shown(routine):
        print(f"dflash_jax: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(what: str, done: str | None = None, routine: bool = False) -> Iterator[list[str]]:
    """Reports a step of work: ``<what> ...`` when it starts (only for steps that are not
    ``routine``: those are slow enough that a user wonders what happens) and ``<done> in <s> s``
    when it ends (``done`` defaults to ``what``). The block may append details to the yielded
    list; they are added to the end line in parentheses. Nothing is printed when the block raises.
    """
    if not routine:
        note(f"{what} ...")
    details: list[str] = []
    t0 = time.perf_counter()
    yield details
    extra = f" ({'; '.join(details)})" if details else ""
    note(f"{done or what} in {time.perf_counter() - t0:.1f} s{extra}", routine=routine)
