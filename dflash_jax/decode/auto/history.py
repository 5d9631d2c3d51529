"""What one generation's adaptive schedule leaves to the next in this process (``n_max="auto"``).

Without it each generation starts the policy afresh: every row trusts its calibrated predictions
fully (``trust = 1``) and the plain runs between proposes restart at 1, 2, 4, ... steps. Where
drafting does not pay for the text at hand, every answer then pays its first probes again: on a
2-core CPU a drafting step costs 2.4-2.6 plain steps and commits little more than one token where
its drafts are rejected, and an answer of 128 tokens holds six such probes (steps 0, 2, 5, 10, 19
and 36), a loss of 4-6 % (BENCHMARKS.md, "On a quiet machine"). The server's batch lives across
requests, so its schedule goes on from one request to the next, and a request's rows join with
the trust of the rows running beside them (:func:`joining`).

So :func:`dflash_jax.generate` keeps, per pair, batch size, decoding settings, sampling settings
and costs (:func:`key`), what the last generation's schedule ended with: the rows' mean online
acceptance (``trust``), the backoff and the plain steps still to take. The next generation of the
same key starts there (:func:`resume`). Only speed depends on it: which steps draft never
changes a token (greedy output is the target's own greedy decode; a seeded sample is drawn from
the target's distribution at every slot, drafted or not), and a generation's statistics say
where its schedule started (``schedule_from``). :func:`forget` clears what is kept.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.state import DecodeState
from dflash_jax.runtime.distributed import fetch

_KEPT: dict[Hashable, dict] = {}
_LOCK = threading.Lock()
_KEEP = 32


def key(cost_key: dict, sampling: Any, model: Any) -> Hashable:
    """What a kept schedule belongs to: the cost key (device, package, pair, decoding settings
    and batch: :func:`~dflash_jax.decode.auto.costs.cost_key`), the sampling settings (acceptance
    at temperature 0.7 is not greedy acceptance) and the costs that priced the steps."""
    return json.dumps(cost_key, sort_keys=True), sampling, (model.widths, model.bounds, model.step_cost, model.plain_cost)


def resume(state: DecodeState, k: Hashable) -> tuple[DecodeState, dict | None]:
    """``state`` (a fresh adaptive state) with the schedule kept for ``k``, if any: every row's
    ``trust`` (``[B]`` float32) the kept mean, ``backoff`` and ``plain_left`` (``[]`` int32, steps)
    as kept, each in its old placement. Returns ``(state, {"trust", "backoff", "plain_left"} as
    kept, or None)``. Raises nothing: an unknown key leaves ``state`` as it is."""
    with _LOCK:
        kept = _KEPT.get(k)
    if kept is None:
        return state, None
    sp = state.speculative

    def like(old, value):  # same shape, dtype and placement (a mesh's): the compiled step takes it as it is
        return jax.device_put(np.full(old.shape, value, old.dtype), old.sharding)

    sp = sp.replace(trust=like(sp.trust, kept["trust"]), backoff=like(sp.backoff, kept["backoff"]),
                    plain_left=like(sp.plain_left, kept["plain_left"]))
    return state.replace(speculative=sp), dict(kept)


def keep(k: Hashable, state: DecodeState) -> None:
    """Keeps the schedule a finished generation's ``state`` ended with for ``k`` (the last
    :data:`_KEEP` keys)."""
    sp = state.speculative
    trust, backoff, plain_left = fetch((sp.trust, sp.backoff, sp.plain_left))  # a collective under several processes
    entry = dict(trust=round(float(np.mean(trust)), 4), backoff=int(backoff), plain_left=int(plain_left))
    with _LOCK:
        _KEPT.pop(k, None)
        while len(_KEPT) >= _KEEP:
            _KEPT.pop(next(iter(_KEPT)))
        _KEPT[k] = entry


@functools.partial(jax.jit, donate_argnames=("fresh",))
def joining(state: DecodeState, fresh: DecodeState) -> DecodeState:
    """``fresh`` (donated; prefilled rows about to join the batch ``state``) with each row's
    ``trust`` the mean trust of ``state``'s running rows, or of all its rows when none runs (their
    last values; 1 in a batch that never decoded): a request of the server starts from what the
    batch has learnt, as a generation of :func:`dflash_jax.generate` does (:func:`resume`)."""
    trust, running = state.speculative.trust, ~state.done
    n = jnp.sum(running)
    mean = jnp.where(n > 0, jnp.sum(jnp.where(running, trust, 0.0)) / jnp.maximum(n, 1), jnp.mean(trust))
    sp = fresh.speculative
    return fresh.replace(speculative=sp.replace(trust=jnp.full_like(sp.trust, mean)))


def forget() -> None:
    """Clears every kept schedule: the next generation of each key starts afresh."""
    with _LOCK:
        _KEPT.clear()
