"""The cost model of the adaptive depth policy (``n_max="auto"``): measured, cached on disk.

A :class:`CostModel` holds the seconds of one decode step of the loaded pair on the running
device, for the batch of a generation: a step that proposes and verifies ``w`` drafts (for the
few widths of ``Decoding.auto_widths``: :func:`~dflash_jax.decode.auto.policy.verify_widths` of a
chain, :func:`~dflash_jax.decode.auto.policy.tree_widths` of a tree) and a plain step (no
propose, the anchor alone). :func:`measure` times the
generation's own compiled loop (or step), run with policies that force each width in turn
(:meth:`CostModel.forcing`), so measuring compiles nothing. :func:`cost_model_for` keeps the
result in ``<cache folder>/depth_costs`` (next to the compilation cache, ``jax_cache``), keyed
by device, JAX version, this package's source, models and batch size (:func:`cost_key`): once
per machine, version, pair and batch size, never per prompt, budget or setting; it measures again on request (``refresh``:
``--measure-costs``) and never keeps a measurement whose timings did not settle.
:func:`depth_policy` joins a cost model and the drafter's calibration into the arrays a step
reads (``Params.depth``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import numbers
import os
import time
from pathlib import Path
from typing import Callable, Sequence
import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax.runtime import distributed
from dflash_jax.runtime.compiled import source_hash
from dflash_jax import progress
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.formats.files import write_text
from dflash_jax.nn.params import is_per_layer
from dflash_jax.decode.auto.policy import MAX_BACKOFF, MAX_BACKOFF_LIMIT, PAY_MARGIN, PROBE_LOSS, Calibration, DepthPolicy, verify_widths


NEVER = 2**31 - 1  # the bound of the last live-length bucket
FORMAT = 2  # part of every cache key: raise it when the steps change what they cost
MEASURE_LIVE = 128  # tokens: the live length steps are timed at (the first key block)
STABLE = 0.10  # a kind's two fastest runs within 10%: the timings have settled
BUSY_SHARE = 0.75  # CPU backend: below this many CPU seconds of the process per second of timed runs, the machine was busy
_clock, _cpu_clock = time.perf_counter, time.process_time  # wall and process CPU time (a test fakes them)
REMEASURE_S = 600.0  # a measurement not kept serves this process's later runs this long, then is measured again
_UNKEPT: dict[str, tuple[float, "CostModel"]] = {}  # key -> (when, costs) of measurements not kept
_FORBIDDEN = 1e9  # seconds: a width no policy chooses


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds of one decode step, per live-length bucket.

    ``widths`` are the widths a step of ``n_max="auto"`` chooses from (``Decoding.auto_widths``):
    ``(1, 3, 7)`` for 7 drafts, 3 step costs per bucket; ``(1,)`` for auto over one draft;
    ``(3,)`` for a tree of 3 nodes. :func:`measure` (or :func:`cost_model_for`) gives one
    measured on the running device; :meth:`forcing` and :meth:`never_pays` make ones that force
    a width or plain steps.

    Attributes:
      step_cost: ``K`` tuples of seconds, one per width: a step that proposes and verifies
        ``widths[j]`` drafts.
      plain_cost: ``K`` seconds of a plain step (no propose, one target token per row).
      widths: the widths priced, ascending (the last is the drafted depth ``n``).
      bounds: ``K`` ascending upper bounds (tokens) of the live-length buckets (default one
        bucket for every length).
      info: how it was obtained (source, date, seconds, whether the timings settled), not
        compared.
    Raises:
      DFlashError: ragged or non-positive costs, or bounds that do not fit (names ``cost_model``).
    """

    step_cost: tuple[tuple[float, ...], ...]
    plain_cost: tuple[float, ...]
    widths: tuple[int, ...]
    bounds: tuple[int, ...] = (NEVER,)
    info: dict | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for name, depth in (("step_cost", 2), ("plain_cost", 1), ("bounds", 1)):
            value = getattr(self, name)
            try:
                ok = all(isinstance(c, numbers.Real) and not isinstance(c, bool)
                         for c in ((x for r in value for x in r) if depth == 2 else value))
            except TypeError:
                ok = False
            if not ok or isinstance(value, (str, bytes)):
                want = "a sequence (one per live-length bucket) of sequences of seconds" if depth == 2 else "a sequence of numbers, one per live-length bucket"
                raise DFlashError(f"cost_model.{name}", f"got {value!r}", want)
        k = len(self.bounds)
        rows = [tuple(float(c) for c in r) for r in self.step_cost]
        widths = self.widths
        if (isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths
                or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 1 for w in widths)
                or list(widths) != sorted(set(widths))):
            raise DFlashError("cost_model.widths", f"got {widths!r}",
                              "ascending distinct verify widths (Decoding.auto_widths), e.g. (1, 3, 7) for 7 drafts, (3, 7) for a tree of 7 nodes")
        if k < 1 or len(rows) != k or len(self.plain_cost) != k or {len(r) for r in rows} != {len(widths)}:
            raise DFlashError("cost_model", f"{len(rows)} step-cost rows of {sorted({len(r) for r in rows})} costs, {len(self.plain_cost)} plain costs, {k} bounds",
                              f"one row of {len(widths)} step costs (one per width) and one plain cost per live-length bound")
        values = [c for r in rows for c in r] + [float(c) for c in self.plain_cost]
        if not all(math.isfinite(c) and c > 0 for c in values):
            raise DFlashError("cost_model", "a cost that is not a positive finite number of seconds", "positive seconds")
        if list(self.bounds) != sorted(set(int(b) for b in self.bounds)):
            raise DFlashError("cost_model.bounds", f"got {self.bounds}", "ascending distinct token counts")
        object.__setattr__(self, "step_cost", tuple(rows))
        object.__setattr__(self, "widths", tuple(int(w) for w in widths))
        object.__setattr__(self, "plain_cost", tuple(float(c) for c in self.plain_cost))

    @property
    def n(self) -> int:
        """The deepest width (drafted tokens) the model prices."""
        return self.widths[-1]

    @staticmethod
    def forcing(n: int, width: int, widths: Sequence[int] | None = None) -> "CostModel":
        """A cost model under which every step proposes and verifies exactly ``width`` drafts, one
        of ``widths`` (default ``verify_widths(n)``, a chain's; every other width and the plain
        step cost :data:`_FORBIDDEN` seconds). Raises DFlashError for another width."""
        widths = tuple(widths or verify_widths(n))
        if width not in widths:
            raise DFlashError("width", f"got {width!r}", f"one of the verify widths {widths}")
        return CostModel(step_cost=(tuple(1.0 if w == width else _FORBIDDEN for w in widths),), plain_cost=(_FORBIDDEN,), widths=widths)

    @staticmethod
    def never_pays(n: int, widths: Sequence[int] | None = None) -> "CostModel":
        """A cost model under which drafting never pays (a plain step is almost free): proposes
        alternate with plain runs of 1, 2, 4, ... steps (:func:`~dflash_jax.decode.auto.policy.schedule`).
        ``widths``: as :meth:`forcing`."""
        widths = tuple(widths or verify_widths(n))
        return CostModel(step_cost=((1.0,) * len(widths),), plain_cost=(1.0 / _FORBIDDEN,), widths=widths)


def check_constants(max_backoff, pay_margin) -> None:
    """Checks the two constants of the depth policy (:mod:`dflash_jax.decode.auto.policy`).

    Raises:
      DFlashError: ``max_backoff`` not an integer in ``[1, 2**30]``; ``pay_margin`` not a number in
        ``[0, 1e6]``.
    """
    if isinstance(max_backoff, bool) or not isinstance(max_backoff, numbers.Integral) or not 1 <= max_backoff <= 2**30:
        raise DFlashError("max_backoff", f"got {max_backoff!r}", "an integer from 1 to 2**30: plain steps between two proposes")
    if isinstance(pay_margin, bool) or not isinstance(pay_margin, numbers.Real) or not 0 <= pay_margin <= 1e6:
        raise DFlashError("pay_margin", f"got {pay_margin!r}", "a number from 0 to 1e6; 0.05: drafting must beat a plain step by 5%")


def with_constants(policy: DepthPolicy, max_backoff: int | None = None, pay_margin: float | None = None) -> DepthPolicy:
    """``policy`` with the constants given (``None``: keep the policy's), in the same shapes and
    dtypes, so nothing recompiles.

    Raises:
      DFlashError: see :func:`check_constants`.
    """
    max_backoff = int(policy.max_backoff) if max_backoff is None else max_backoff
    pay_margin = float(policy.pay_margin) if pay_margin is None else pay_margin
    check_constants(max_backoff, pay_margin)
    return policy.replace(max_backoff=jnp.int32(max_backoff), pay_margin=jnp.float32(pay_margin))


def probe_backoff(costs: CostModel) -> int:
    """The longest run of plain steps between two proposes (``max_backoff``) for ``costs``: the
    fewest plain steps after which a propose whose drafts are all rejected has cost at most
    :data:`~dflash_jax.decode.auto.policy.PROBE_LOSS` of plain decoding's speed,
    ``ceil((C / C_plain - 1) / PROBE_LOSS)`` with ``C`` the cheapest drafting step (worst bucket),
    within ``[MAX_BACKOFF, MAX_BACKOFF_LIMIT]``. Where a drafting step costs 1.05 plain steps (a
    GPU) that is :data:`~dflash_jax.decode.auto.policy.MAX_BACKOFF`; where it costs 2.4 (the
    default pair's tree of 3 on a 2-core CPU) 140: a machine where drafting rarely pays probes
    rarely."""
    ratio = max(min(step) / plain for step, plain in zip(costs.step_cost, costs.plain_cost))
    return int(min(max(math.ceil((ratio - 1.0) / PROBE_LOSS), MAX_BACKOFF), MAX_BACKOFF_LIMIT))


def depth_policy(calibration: Calibration, costs: CostModel, max_backoff: int | None = None,
                 pay_margin: float = PAY_MARGIN, depth: int | None = None) -> DepthPolicy:
    """The arrays of ``Params.depth`` from a drafter's calibration, a cost model, the longest run
    of plain steps between two proposes (``max_backoff``; ``None``: :func:`probe_backoff` of the
    costs) and the fraction by which drafting must beat a plain step (``pay_margin``;
    :mod:`dflash_jax.decode.auto.policy`).

    Args:
      depth: the drafted depth, the calibrated positions a step reads (``None``: ``costs.n``, a
        chain's; a tree of ``costs.n`` nodes is ``Decoding.depth`` deep).
    Raises:
      DFlashError: a cost model (or ``depth``) of more drafts than the calibration covers (a
        longer calibration is cut to the drafted depth: auto over fewer drafts than the block);
        a bad constant (:func:`check_constants`).
    """
    max_backoff = probe_backoff(costs) if max_backoff is None else max_backoff
    check_constants(max_backoff, pay_margin)
    n = costs.n if depth is None else int(depth)
    if len(calibration.scale) < n:
        raise DFlashError("cost_model", f"prices {n} drafted tokens", f"at most {len(calibration.scale)} (the calibrated draft positions)")
    calibration = Calibration(calibration.scale[:n], calibration.bias[:n])  # auto over fewer drafts: the first positions
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))  # noqa: E731
    return DepthPolicy(scale=f32(calibration.scale), bias=f32(calibration.bias), bounds=jnp.asarray(np.asarray(costs.bounds, np.int32)),
                       step_cost=f32(costs.step_cost), plain_cost=f32(costs.plain_cost), max_backoff=jnp.int32(max_backoff),
                       pay_margin=jnp.float32(pay_margin))


def _copy(state):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def probe_state(state):
    """``state`` with every row running: the shapes of a generation's state to time steps on
    (its rows need not be prefilled, nor hold a user's prompt: a step costs the same whatever
    the cache holds, and :func:`measure` sets the rows' lengths)."""
    return state.replace(finish=jnp.zeros_like(state.finish))


def _at_length(state, live: int | None, tokens: int):
    """A copy of ``state`` whose running rows are ``live`` tokens long (``None``: as they are;
    the rows past their real length hold stale slots, which cost what live ones do) with a
    budget of ``tokens`` new tokens."""
    s = _copy(state)
    if live is not None:
        length = jnp.where(s.done, s.length, jnp.clip(jnp.maximum(s.length, live), 1, s.capacity - tokens - 1))
        s = s.replace(length=length, prompt_len=length - 1)
    return s.replace(max_new=s.new_tokens + tokens)


def _time_kinds(run, params, base, widths: tuple[int, ...], rounds: int, max_rounds: int, depth: int) -> tuple[list[float], float, bool, float]:
    """Seconds per step of every verify width and of the plain step: the fastest of ``rounds``
    runs each (kinds alternating, so a burst of load hits every kind alike), more rounds (up to
    ``max_rounds``) while some kind's two fastest runs differ by more than :data:`STABLE`; made
    non-decreasing in the width by an isotonic fit, the plain step at most the narrowest.
    Returns ``(step costs, plain cost, stable, cpu share)``: the share is the process's CPU
    seconds per wall second over the timed runs (:func:`_busy`)."""
    ident, n = Calibration.identity(depth), widths[-1]
    kinds = [(depth_policy(ident, CostModel.forcing(n, w, widths), depth=depth), False) for w in widths]
    kinds.append((depth_policy(ident, CostModel.forcing(n, n, widths), depth=depth), True))  # plain: the schedule says plain throughout
    times: list[list[float]] = [[] for _ in kinds]
    wall = cpu = 0.0
    stable = False
    for r in range(max_rounds):
        for i, (policy, plain) in enumerate(kinds):
            s = _copy(base)
            if plain:
                s = s.replace(speculative=s.speculative.replace(plain_left=jnp.int32(NEVER)))
            jax.block_until_ready(s)
            t0, c0 = _clock(), _cpu_clock()
            s = run(params._replace(depth=policy), s)
            steps = int(jax.device_get(s.steps - base.steps))  # waits for the run
            dt = _clock() - t0
            wall, cpu = wall + dt, cpu + _cpu_clock() - c0
            times[i].append(dt / max(steps, 1))
        stable = all(sorted(t)[1] <= (1 + STABLE) * min(t) for t in times) if r >= 1 else False
        if r + 1 >= rounds and stable:
            break
    best = [min(t) for t in times]
    from scipy.optimize import isotonic_regression  # here: importing scipy.optimize takes 0.4-0.8 s of every start

    step = [float(c) for c in isotonic_regression(best[:-1]).x]
    return step, min(best[-1], step[0]), stable, cpu / max(wall, 1e-9)


def _busy(cpu_share: float) -> bool:
    """Whether timings with this CPU share were taken on a busy machine. On the CPU backend a
    step keeps at least one of the process's threads computing for its whole wall time, so a
    process that got the cores it asked for shows a share of 1 or more; other processes on the
    same cores take turns with it, and its share falls to about cores / load (0.4 at load 5 on 2
    cores). Below :data:`BUSY_SHARE` the machine was busy. Steady load passes the spread test
    (:data:`STABLE`: every run is slow alike), not this one. On an accelerator the host waits
    while the device computes: the share says nothing there, and is not read.
    ``$DFLASH_JAX_BUSY_SHARE`` replaces the bound (``0``: never busy; the test suite, which runs
    beside other jobs, sets it).

    Raises:
      DFlashError: ``$DFLASH_JAX_BUSY_SHARE`` that is not a number from 0 to 16.
    """
    raw = os.environ.get("DFLASH_JAX_BUSY_SHARE", "")
    try:
        bound = float(raw) if raw else BUSY_SHARE
        ok = 0 <= bound <= 16
    except ValueError:
        ok = False
    if not ok:
        raise DFlashError("DFLASH_JAX_BUSY_SHARE", f"got {raw!r}", "a number from 0 to 16 (CPU seconds per second; 0: never busy)")
    return jax.default_backend() == "cpu" and cpu_share < bound


def measure(run: Callable, params: Params, state, static: Decoding, tokens: int = 8, rounds: int = 3,
            lengths: Sequence[int] | None = (MEASURE_LIVE,), max_rounds: int = 8) -> CostModel:
    """Times one step of each kind with the generation's own compiled ``run``.

    Args:
      run: ``run(params, state) -> state``, the compiled loop or step of the generation (it may
        donate the state; every run gets a copy).
      params: with any ``depth`` of the right shapes (replaced here).
      state: a state of the generation's shapes with running rows (read only), e.g.
        :func:`probe_state`.
      static: the adaptive :class:`~dflash_jax.decode.state.Decoding`.
      tokens: new tokens per row per timed run.
      rounds, max_rounds: runs per kind, alternating kinds; the fastest counts, and rounds go on
        past ``rounds`` while the timings are not stable (:func:`_time_kinds`).
      lengths: live-length buckets to price, ascending (each measured with the running rows
        that long); default one bucket, timed at :data:`MEASURE_LIVE` tokens (within the first key
        block of the live-length attention, which every answer reads: the steps' attention reads
        each key block once for all of a step's queries, so a longer context adds about the same
        seconds to every width); ``None``: one bucket at the state's own lengths.
    Returns:
      A :class:`CostModel` (seconds per step, ``info``: ``source`` ``"measured"``, ``stable``:
      whether the timings settled, ``cpu_share`` and ``busy``: the process's CPU seconds per
      wall second of the timed runs and whether that says the machine was busy, :func:`_busy`); equal costs
      (``info["source"]`` ``"none"``) when every row is done already (no step will run).
    """
    widths = static.auto_widths
    if bool(jax.device_get(jnp.all(state.done))):
        return CostModel(step_cost=((1.0,) * len(widths),), plain_cost=(1.0,), widths=widths, info=dict(source="none"))
    timed = [_time_kinds(run, params, _at_length(state, live, tokens), widths, rounds, max_rounds, static.depth) for live in (lengths or [None])]
    step, plain, stable, share = zip(*timed)
    return CostModel(step_cost=step, plain_cost=plain, widths=widths, bounds=tuple(lengths or (NEVER,)),
                     info=dict(source="measured", stable=all(stable), cpu_share=round(min(share), 3), busy=any(map(_busy, share))))


def adaptive_params(params: Params, static: Decoding, calibration: Calibration, run: Callable, key: dict, state,
                    cost_model: CostModel | str | None = None) -> tuple[Params, CostModel]:
    """``params`` with the depth policy of ``n_max="auto"`` set, and its cost model: ``cost_model``
    when it is a :class:`CostModel`, else the one kept for ``key`` (:func:`cost_key`) or measured
    with ``run`` (:func:`measure`; ``"refresh"``: measured again) on copies of
    :func:`probe_state` of ``state`` (a state of ``run``'s shapes, prefilled or not). The
    generation's driver and the serving engine both call it before they prefill a prompt. Across
    processes (:mod:`dflash_jax.runtime.distributed`) all measure or none does, and all take process 0's
    numbers."""
    if not isinstance(cost_model, CostModel):
        measure_now = lambda: measure(run, params, probe_state(state), static)  # noqa: E731
        refresh = cost_model == "refresh"
        if jax.process_count() > 1:  # every process measures (the runs are collective), or none does
            refresh = refresh or not distributed.everywhere(load_cached(key, static.auto_widths) is not None)
        cost_model = cost_model_for(key, measure_now, refresh=refresh, widths=static.auto_widths)
        if jax.process_count() > 1:  # one policy for every process: process 0's numbers
            step, plain = distributed.leaders((np.asarray(cost_model.step_cost), np.asarray(cost_model.plain_cost)))
            cost_model = dataclasses.replace(cost_model, step_cost=tuple(map(tuple, step.tolist())), plain_cost=tuple(plain.tolist()))
    return params._replace(depth=depth_policy(calibration, cost_model, depth=static.depth)), cost_model


def costs_dir() -> Path:
    """Where measured cost models are kept: ``<cache folder>/depth_costs``, next to the
    compilation cache (``<cache folder>/jax_cache``)."""
    from dflash_jax.assets.default_model import cache_dir

    return cache_dir() / "depth_costs"


def cost_key(static: Decoding, params: Params, batch: int, sources: tuple[str, ...]) -> dict:
    """What a cost model depends on: device, JAX, this package's source
    (:func:`~dflash_jax.runtime.compiled.source_hash`: a changed step is measured again, where a
    kept measurement of the old step would decide every later run), the models (sources, configs,
    dtype, layouts) and the batch. Not the capacity (the steps read the live prefix of the cache, not its
    capacity), the sampling settings, the draft mode, the prompt or how the steps are run (a
    loop on device or steps from Python): each moves every kind's cost alike by a little, so
    one measurement serves a machine and a pair at each batch size."""
    dev = jax.devices()[0]
    layout = ["per-layer" if is_per_layer(p.get("layers")) else "stacked" for p in params.trees()[:2]
              if isinstance(p, dict)]
    digest = hashlib.sha256(repr((static.target, static.drafter)).encode()).hexdigest()[:16]
    key = dict(device=f"{dev.platform}:{dev.device_kind}", devices=jax.device_count(), jax=jax.__version__,
               package=source_hash()[:16], format=FORMAT, sources=list(sources), models=digest, layout=layout, batch=int(batch))
    if static.tree:  # a tree step's pass of w nodes is priced apart from a chain's of w drafts
        key.update(tree=int(static.tree), depth=int(static.depth))
    return key


def _entry_path(key: dict) -> Path:
    return costs_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def load_cached(key: dict, widths: Sequence[int] | None = None) -> CostModel | None:
    """The cost model kept for ``key``, or ``None`` (none kept, an unreadable entry, or one that
    does not price the verify ``widths`` given)."""
    path = _entry_path(key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        model = CostModel(step_cost=tuple(map(tuple, data["step_cost"])), plain_cost=tuple(data["plain_cost"]),
                          widths=tuple(data["widths"]), bounds=tuple(data["bounds"]), info=dict(data.get("info", {}), source="cached", path=str(path)))
    except (OSError, ValueError, KeyError, TypeError, DFlashError):
        return None
    return None if widths is not None and model.widths != tuple(widths) else model


def store(key: dict, costs: CostModel) -> Path:
    """Keeps ``costs`` for ``key`` (atomically); returns the file."""
    path = _entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(key=key, step_cost=costs.step_cost, plain_cost=costs.plain_cost, widths=costs.widths, bounds=costs.bounds,
                info=costs.info or {})
    return write_text(path, json.dumps(data, indent=1))


def cost_model_for(key: dict, measure_fn: Callable[[], CostModel], refresh: bool = False, widths: Sequence[int] | None = None) -> CostModel:
    """The kept cost model of ``key`` (one that prices the verify ``widths``, when given), else (or
    with ``refresh``) ``measure_fn()`` (:func:`measure`), reported on stderr (it takes seconds).

    A measurement is kept only when its timings settled (``info["stable"]``, :func:`_time_kinds`)
    and the process had the CPU to itself (not ``info["busy"]``, :func:`_busy`): one taken while
    other processes kept the machine busy is used for this run and measured again next time, so
    it never decides the choices of later runs. Within this process it serves the runs of the
    next :data:`REMEASURE_S` seconds (a busy machine is not measured again at every call;
    ``info["source"]`` ``"unkept"``), then is measured again.
    """
    mem = json.dumps([str(costs_dir()), key], sort_keys=True)
    if not refresh:
        kept = load_cached(key, widths)
        if kept is not None:
            return kept
        when, unkept = _UNKEPT.get(mem, (-math.inf, None))
        if unkept is not None and time.monotonic() - when < REMEASURE_S and (widths is None or unkept.widths == tuple(widths)):
            return dataclasses.replace(unkept, info=dict(unkept.info, source="unkept"))
    t0 = time.perf_counter()
    with progress.step("measuring the step costs of n_max auto (once per machine, pair and batch size)",
                       "measured the step costs of n_max auto") as details:
        costs = measure_fn()
        info = costs.info or {}
        if info.get("source") == "measured" and not info.get("stable", True):
            details.append("the timings did not settle (a busy machine?): used now, not kept")
        elif info.get("source") == "measured" and info.get("busy"):
            details.append(f"the machine was busy (this process had {info.get('cpu_share')} CPU seconds per second): used now, not kept")
    if info.get("source") != "measured":
        return costs
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    costs = dataclasses.replace(costs, info=dict(info, date=when, seconds=round(time.perf_counter() - t0, 3)))
    if not info.get("stable", True) or info.get("busy"):
        _UNKEPT[mem] = (time.monotonic(), costs)
    else:
        _UNKEPT.pop(mem, None)
        try:
            store(key, costs)
        except OSError:  # a read-only cache folder: use the measurement without keeping it
            pass
    return costs
