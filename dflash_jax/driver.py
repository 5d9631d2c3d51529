"""The timed generation driver behind :func:`dflash_jax.generate` (plain or DFlash decoding).

It checks the arguments (:mod:`dflash_jax.arguments`), compiles every step ahead of time
(``jax.jit(...).lower(...).compile()``) before the clock starts, runs :mod:`dflash_jax.decode.loop`'s
prefill and its on-device loop (or steps it from Python to stream), and reads the finished state back
into a :class:`GenerationResult` (ids, texts, statistics: :func:`build_result`). The reported times
exclude compilation.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import progress
from dflash_jax.arguments import Request, check_request
from dflash_jax.decode.loop import decode_step, generate_until, init_state, stream
from dflash_jax.decode.auto import costs, history
from dflash_jax.decode.prefill import compile_prefill, prefill
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.state import FINISH_REASONS, RUNNING, STOP
from dflash_jax.loading import Drafter, Target
from dflash_jax.runtime import compiled
from dflash_jax.runtime import sharding
from dflash_jax.runtime.compiled import (
    count_cache_hits,
    count_compilations,
    count_store_reads,
)
from dflash_jax.runtime.distributed import fetch
from dflash_jax.text import TextStream, cut_at_stop_text, find_stop

_COMPILED: dict = {}
_COMPILED_KEEP = 8


def _signature(tree) -> tuple:
    """The tree structure with every leaf's shape, dtype and sharding: what a compiled program is
    specialised to."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves)


def _compile(req: Request, state, streaming: bool):
    """``(prefill, run)`` compiled for these shapes: :func:`dflash_jax.decode.prefill.compile_prefill`'s
    pair and ``run(params, state)``, the whole on-device loop or (``streaming``) one step.

    Kept in memory for the last few shapes: with the default capacity and chunk buckets
    (:func:`~dflash_jax.arguments.default_max_len`), a second ``generate`` with another prompt
    and budget in the same process compiles nothing (across processes the persistent compilation
    cache does the same)."""
    key = (req.static, req.chunk_size, streaming, _signature(req.params), _signature(state))
    if key not in _COMPILED:
        while len(_COMPILED) >= _COMPILED_KEEP:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = _compile_now(req, state, streaming)
    return _COMPILED[key]


def _compile_now(req: Request, state, streaming: bool):
    # prefill and decode side by side: reading an executable back (or compiling it) is mostly
    # outside the GIL, and the two take about 0.5 s and 1.6 s on this CPU (BENCHMARKS.md)
    with ThreadPoolExecutor(1) as pool:
        prefill_c = pool.submit(compile_prefill, req.params, state, req.static, req.chunk_size)
        if streaming:
            step = compiled.compile(decode_step, req.params, state, req.static)
            return prefill_c.result(), step
        rows = jnp.int32(state.tokens.shape[0])
        loop = compiled.compile(generate_until, req.params, state, req.static, rows)
        return prefill_c.result(), lambda params, s: loop(params, s, rows)


def _compile_reported(req: Request, state, streaming: bool):
    """:func:`_compile`, reported as a progress step (programs compiled, compile-cache hits)."""
    with progress.step("compiling", "compiled prefill and decode", routine=True) as details, \
            count_compilations() as programs, count_cache_hits() as hits, count_store_reads() as stored:
        out = _compile(req, state, streaming)
        details.append(f"capacity {req.max_len}, chunk {req.chunk_size}: {programs()} XLA programs, {hits()} read from the compile cache, "
                       f"{stored()} read back from jax_cache/executables")
    return out


def _with_policy(req: Request, target: Target, drafter: Drafter, state, run, streaming: bool) -> tuple[Request, Any, dict, Any]:
    """``req`` with ``params.depth`` set for ``n_max="auto"`` (:func:`dflash_jax.decode.auto.costs.adaptive_params`:
    the costs given, kept on disk for this machine, pair and batch size, or measured once with
    ``run`` on copies of the initial ``state`` whose rows it sets to a fixed length, before the
    prompts are prefilled); ``state`` going on from the schedule the last generation of this key
    ended with (:func:`dflash_jax.decode.auto.history.resume`); the statistics that say where the
    costs and the schedule came from; and that key (``None`` unless ``"auto"``)."""
    if not req.static.adaptive:
        return req, state, {}, None

    def steps(params, s):  # streaming compiles one step: run it until the rows are done
        while not bool(jax.device_get(jnp.all(s.done))):
            s = run(params, s)
        return s

    key = costs.cost_key(req.static, req.params, len(req.prompts), (target.source, drafter.source))
    params, model = costs.adaptive_params(req.params, req.static, req.calibration, steps if streaming else run, key, state, req.cost_model)
    info = model.info or {}
    schedule_key = history.key(key, req.sampling, model)
    state, schedule_from = history.resume(state, schedule_key)
    return dataclasses.replace(req, params=params), state, dict(
        cost_model=info.get("source", "given"), cost_model_s=info.get("seconds", 0.0) if info.get("source") == "measured" else 0.0,
        cost_widths=list(model.widths), step_cost_ms=[round(1000 * c, 3) for c in model.step_cost[0]],
        plain_cost_ms=round(1000 * model.plain_cost[0], 3), schedule_from=schedule_from), schedule_key


def _stream(req: Request, tokenizer, state, run, on_tokens) -> tuple[Any, float]:
    """Steps ``run`` from Python, calling ``on_tokens`` with each row's new ids; a row whose text
    reaches a stop text is frozen (finish code ``STOP``). Returns ``(state, seconds in callbacks)``."""
    batch = len(req.prompts)
    forced = np.zeros(batch, bool)
    streams = [TextStream(tokenizer, req.stop_texts) for _ in range(batch)] if req.stop_texts else None
    callback_s = 0.0

    def step(s):
        if forced.any():  # a stop text ended these rows: freeze them
            s = s.replace(finish=jnp.where(jnp.asarray(forced) & ~s.done, STOP, s.finish))
        return run(req.params, s)

    for state, toks, counts in stream(req.params, state, req.static, step=step):
        new = [[int(t) for t in toks[b, : counts[b]]] if not forced[b] else [] for b in range(batch)]
        for b in range(batch):
            if streams is not None and new[b] and not forced[b]:
                streams[b].feed(new[b])
                forced[b] = streams[b].stopped
        c0 = time.perf_counter()
        on_tokens(new)
        callback_s += time.perf_counter() - c0
        if np.all(forced | (np.asarray(fetch(state.finish)) != RUNNING)):
            break
    return state, callback_s


def _initial_state(req: Request, target: Target):
    """The request's fresh decode state, laid out on the target's mesh when it has one (rows over
    ``"data"``, cache heads over ``"model"``, like the parameters)."""
    state = init_state(req.static, req.prompts, req.max_len, req.max_new_tokens, req.stop_ids, req.seed, req.sampling)
    return state if target.mesh is None else sharding.shard_state(state, target.mesh)


def _prefill_and_decode(req: Request, target: Target, state, prefill_c, run, on_tokens) -> tuple[Any, dict]:
    """Prefills ``state`` and decodes it to the end (the loop on device, or its steps from Python
    when ``on_tokens`` streams), each timed: ``(state, {prefill_time_s, decode_time_s})``, the
    callbacks' own time left out of the decode time."""
    jax.block_until_ready((req.params, state))
    t0 = time.perf_counter()
    state = prefill(req.params, state, req.static, req.chunk_size, max(len(p) for p in req.prompts), compiled=prefill_c)
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - t0

    t0, callback_s = time.perf_counter(), 0.0
    if on_tokens is None:
        state = run(req.params, state)
    else:
        state, callback_s = _stream(req, target.tokenizer, state, run, on_tokens)
    jax.block_until_ready(state)
    return state, dict(prefill_time_s=prefill_s, decode_time_s=time.perf_counter() - t0 - callback_s)


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *positional,
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    max_len: int | None = None,
    chunk_size: int = 256,
    stop_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    seed: int = 0,
    on_tokens: Callable[[list[list[int]]], Any] | None = None,
    drafter: Drafter | None = None,
    n_max: int | str | None = None,
    draft_mode: str = "argmax",
    cost_model: costs.CostModel | str | None = None,
    tree: int | None = None,
) -> GenerationResult:
    """Generation for a batch of prompts: DFlash speculative decoding with a ``drafter``, plain
    decoding without. Every argument after ``prompts`` is keyword-only.

    Args:
      target: from :func:`~dflash_jax.loading.load_target`.
      prompts: ``B`` lists of token ids (lengths may differ); rows may also be 1-D integer numpy
        or JAX arrays, or the whole batch one ``[B, P]`` integer array.
      max_new_tokens: new-token budget per row (>= 1).
      sampling: :class:`~dflash_jax.decode.sampling.SamplingConfig` (default greedy).
      max_len: capacity per row, prompt included; default: the smallest of ``1024 * 2**k``
        holding the longest prompt + ``max_new_tokens`` (capped at the target's ``max_position_embeddings``, which
        neither may exceed). A row that fills it finishes with ``"capacity"``.
      chunk_size: prompt tokens per prefill pass (capped, see :func:`~dflash_jax.arguments.effective_chunk_size`).
      stop_ids: extra token ids that end a row (kept in the output); ignore_eos: do not stop at EOS; stop: stop texts (see :mod:`dflash_jax`).
      seed: sampling seed in ``[0, 2**63)``; row ``b`` uses ``fold_in(key(seed), b)`` (:mod:`~dflash_jax.decode.sampling`).
      on_tokens: streaming callback, called with ``B`` lists of the ids each row committed since the
        previous call (the first carries prefill's token); decoding is then stepped from Python.
      drafter: a :class:`~dflash_jax.loading.Drafter` for DFlash speculative decoding (``None``:
        plain decoding). Stats then add ``tau`` (tokens per verify step, bonus included), ``verify_steps``,
        ``accepted_per_position``, ``drafted_tokens``, ``accepted_tokens`` and ``tree``.
      n_max: drafted tokens verified per step, or ``"auto"``: each step chooses the width, or a
        plain step, from calibrated confidences and measured costs (:mod:`dflash_jax.decode.auto.policy`;
        stats add ``widths``, ``plain_steps`` (counted as verify steps), the costs used and the
        ``schedule_from`` the last generation left, :mod:`~dflash_jax.decode.auto.history`). Default: the drafter's recorded
        ``n_max`` (``"auto"`` for the shipped drafter), else its ``block_size - 1``.
      draft_mode: ``"argmax"`` (default), ``"sample"`` or ``"reject"`` (:class:`dflash_jax.decode.state.Decoding`).
      cost_model: under ``"auto"``: ``None`` (kept on disk for this device, pair and batch
        size, else measured before the timed decode), ``"refresh"`` or a ``CostModel``.
      tree: ``N``: verify a best-first tree of ``N`` drafted nodes per step (:mod:`~dflash_jax.decode.tree`);
        ``0``: a chain; ``None``: the drafter's recorded tree (:func:`~dflash_jax.arguments.drafter_decoding`).
    Returns:
      :class:`~dflash_jax.driver.GenerationResult`.
    Raises:
      DFlashError: bad prompts (non-integer or out-of-vocabulary ids), a prompt that does not fit
        ``max_len``, bad sizes, a capacity beyond the target's ``max_position_embeddings``, stop
        texts without a tokenizer, an argument of the wrong type or given by position (the message names it).
    """
    req = check_request(target, prompts, max_new_tokens=max_new_tokens, sampling=sampling, max_len=max_len, chunk_size=chunk_size,
                        stop_ids=stop_ids, stop=stop, ignore_eos=ignore_eos, seed=seed, on_tokens=on_tokens, drafter=drafter,
                        n_max=n_max, draft_mode=draft_mode, cost_model=cost_model, tree=tree, positional=positional)
    state = _initial_state(req, target)
    t0 = time.perf_counter()
    prefill_c, run = _compile_reported(req, state, streaming=on_tokens is not None)  # traces shapes only; nothing runs
    compile_s = time.perf_counter() - t0
    req, state, policy_stats, schedule_key = _with_policy(req, target, drafter, state, run, streaming=on_tokens is not None)
    state, timings = _prefill_and_decode(req, target, state, prefill_c, run, on_tokens)
    if schedule_key is not None:  # the next generation of this key goes on from this one's schedule
        history.keep(schedule_key, state)
    timings = dict(compile_time_s=compile_s, **timings)
    extra = dict(mode="plain") if drafter is None else dict(mode="dflash", **spec_stats(state, n_max=req.static.n_max), tree=req.static.tree, **policy_stats)
    return build_result(target, req.prompts, state, req.stop_texts, timings, max_len=req.max_len, chunk_size=req.chunk_size, **extra)


@dataclasses.dataclass
class GenerationResult:
    """What :func:`dflash_jax.generate` returns.

    Attributes:
      prompt_ids: the prompts, ``list[list[int]]``.
      output_ids: generated ids per row (a stop or EOS token that ended the row included).
      finish_reason: per row ``"stop"`` (EOS, stop id or stop text), ``"length"``
        (``max_new_tokens``) or ``"capacity"`` (``max_len`` reached).
      top2_logit_gaps: per row, per output token, the gap between the two largest target logits at
        the step that chose it.
      texts: per row decoded text (special tokens skipped, cut before a stop text), or ``None``
        without a tokenizer.
      stats: ``new_tokens`` (all rows), ``prompt_tokens``, ``compile_time_s``,
        ``prefill_time_s`` (prompt processing and the first token of each row),
        ``decode_time_s``, ``decode_tokens_per_s`` (``(new_tokens - rows) / decode_time_s``: each
        row's first token comes from prefill), ``prefill_tokens_per_s``, ``steps`` (target
        passes after prefill: decode or verify steps), ``batch``, ``max_len``, ``chunk_size``
        (effective), ``dtype``, ``mode`` (``"plain"`` or ``"dflash"``); with a drafter also
        :func:`spec_stats`'s.
    """

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    finish_reason: list[str]
    top2_logit_gaps: list[list[float]]
    texts: list[str] | None
    stats: dict


def spec_stats(state, rows: Sequence[int] | None = None, n_max=None) -> dict:
    """Speculative statistics of a finished state, summed over rows (``docs/specs/dflash.md`` 2.3).

    ``tau``: tokens committed per verify step, bonus included (the first token comes from
    prefill and is not counted, as in z-lab's benchmark; :attr:`DecodeState.committed`); under
    ``n_max="auto"`` its plain steps count as verify steps of the anchor alone.
    ``accepted_per_position[i]``: the fraction of verify steps in which draft position ``i + 1``
    was accepted. Also ``verify_steps``, ``drafted_tokens``, ``accepted_tokens``, ``n_max``
    (the given ``n_max``, e.g. ``"auto"``, else the drafted depth), ``widths`` (steps that
    proposed and verified ``w`` drafts, or a tree of ``w`` nodes, ``w = 0..depth`` (or the tree's
    nodes); batch steps, not rows) and
    ``plain_steps`` (batch steps without a propose).

    Args:
      state: a :class:`~dflash_jax.decode.state.DecodeState` with a speculative extension.
      rows: sum over these rows only (a server reads one request's row); ``verify_steps`` is
        then their own verify passes rather than the batch's target passes (``widths`` and
        ``plain_steps`` stay the batch's).
      n_max: the depth the generation was asked for, reported as given (default: the drafted one).
    """
    sp = state.speculative  # the statistics only: the drafter context stays on device
    fields = (sp.verify_steps, sp.accepted_per_position, sp.drafted, sp.accepted, state.length, state.prompt_len, sp.widths)
    verify, per_pos, drafted, accepted, length, prompt_len, widths = fetch(fields)
    committed = np.maximum(length - prompt_len - 1, 0)  # DecodeState.committed, on the host: no program per batch size
    passes = total = int(fetch(state.steps))
    if rows is not None:
        idx = np.asarray(rows, np.int64)
        verify, per_pos, drafted, accepted, committed = (a[idx] for a in (verify, per_pos, drafted, accepted, committed))
        passes = int(np.sum(verify))
    steps = int(np.sum(verify))
    return dict(
        tau=round(float(np.sum(committed)) / steps, 4) if steps else 0.0,
        verify_steps=passes,
        accepted_per_position=[round(float(x) / steps, 4) if steps else 0.0 for x in np.sum(per_pos, axis=0)],
        drafted_tokens=int(np.sum(drafted)),
        accepted_tokens=int(np.sum(accepted)),
        n_max=int(per_pos.shape[1]) if n_max is None else n_max,
        widths=[int(x) for x in widths],
        plain_steps=total - int(np.sum(widths)),
    )


def _rows(tokenizer, state, batch: int, stop_texts: Sequence[str]):
    """Per row ``(ids, gaps, finish reason, text or None)``, cut at the first stop text."""
    tokens, plen, length, finish, gaps = fetch((state.tokens, state.prompt_len, state.length, state.finish, state.gaps))
    for b in range(batch):
        ids = [int(t) for t in tokens[b, plen[b] : length[b]]]
        g = [float(x) for x in gaps[b, plen[b] : length[b]]]
        reason = FINISH_REASONS[int(finish[b])] or "length"
        cut = cut_at_stop_text(tokenizer, ids, stop_texts) if stop_texts else None
        if cut is not None:
            ids, g, reason = ids[:cut], g[:cut], "stop"
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            c = find_stop(text, stop_texts)
            text = text if c is None else text[:c]
        yield ids, g, reason, text


def build_result(target, prompts: list[list[int]], state, stop_texts: Sequence[str], timings: Mapping[str, float],
                 **extra_stats) -> GenerationResult:
    """Reads a finished decode state back into a :class:`GenerationResult` (shared by every mode).

    Args:
      target: the :class:`~dflash_jax.loading.Target` (its tokenizer decodes the texts).
      prompts: the prompts the state was built from.
      state: a :class:`~dflash_jax.decode.state.DecodeState` after generation.
      stop_texts: stop texts to cut the outputs at: each row's ids end with the token that
        completed the first stop text, its text just before it.
      timings: ``compile_time_s``, ``prefill_time_s``, ``decode_time_s`` in seconds.
      extra_stats: added to ``stats`` as given (``mode``, ``max_len``, ...).
    """
    batch = len(prompts)
    out_ids, out_gaps, reasons, texts = (list(x) for x in zip(*_rows(target.tokenizer, state, batch, stop_texts)))
    plen, length, steps = fetch((state.prompt_len, state.length, state.steps))
    generated = int(np.sum(length - plen))  # before any stop-text cut: what the loop produced
    decode_tokens = generated - batch  # each row's first token comes from prefill
    prefill_s, decode_s = float(timings["prefill_time_s"]), float(timings["decode_time_s"])
    stats = dict(
        mode="plain",
        batch=batch,
        prompt_tokens=int(np.sum(plen)),
        new_tokens=sum(len(x) for x in out_ids),
        generated_tokens=generated,
        steps=int(steps),
        compile_time_s=round(float(timings["compile_time_s"]), 6),
        prefill_time_s=round(prefill_s, 6),
        decode_time_s=round(decode_s, 6),
        prefill_tokens_per_s=round(float(np.sum(plen)) / prefill_s, 3) if prefill_s > 0 else None,
        decode_tokens_per_s=round(decode_tokens / decode_s, 3) if decode_s > 0 and decode_tokens > 0 else 0.0,
        dtype=target.cfg.dtype,
    )
    stats.update(extra_stats)
    return GenerationResult(prompt_ids=[list(p) for p in prompts], output_ids=out_ids, finish_reason=reasons,
                            top2_logit_gaps=out_gaps, texts=texts if target.tokenizer is not None else None, stats=stats)
