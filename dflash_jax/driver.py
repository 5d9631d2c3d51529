"""The timed generation driver behind :func:`dflash_jax.generate` (plain or DFlash decoding).

It checks the arguments (:mod:`dflash_jax.arguments`), compiles every step ahead of time
(``jax.jit(...).lower(...).compile()``) before the clock starts, runs :mod:`dflash_jax.decode`'s
prefill and its on-device loop (or steps it from Python to stream), and reads the result back
(:mod:`dflash_jax.results`). The reported times exclude compilation.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import costs, decode, executables, progress, sharding
from dflash_jax.arguments import Request, check_request
from dflash_jax.distributed import fetch
from dflash_jax.compile_count import count_cache_hits, count_compilations, count_store_reads
from dflash_jax.loading import Drafter, Target
from dflash_jax.prefill import compile_prefill
from dflash_jax.results import GenerationResult, build_result, spec_stats
from dflash_jax.sampling import SamplingConfig
from dflash_jax.state import RUNNING, STOP
from dflash_jax.text import TextStream


_COMPILED: dict = {}
_COMPILED_KEEP = 8


def _signature(tree) -> tuple:
    """The tree structure with every leaf's shape, dtype and sharding: what a compiled program is
    specialised to."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves)


def _compile(req: Request, state, streaming: bool):
    """``(prefill, run)`` compiled for these shapes: :func:`dflash_jax.prefill.compile_prefill`'s
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
            step = executables.compile(decode.decode_step, req.params, state, req.static)
            return prefill_c.result(), step
        rows = jnp.int32(state.tokens.shape[0])
        loop = executables.compile(decode.generate_until, req.params, state, req.static, rows)
        return prefill_c.result(), lambda params, s: loop(params, s, rows)


def _compile_reported(req: Request, state, streaming: bool):
    """:func:`_compile`, reported as a progress step (programs compiled, compile-cache hits)."""
    with progress.step("compiling", "compiled prefill and decode", routine=True) as details, \
            count_compilations() as programs, count_cache_hits() as hits, count_store_reads() as stored:
        out = _compile(req, state, streaming)
        details.append(f"capacity {req.max_len}, chunk {req.chunk_size}: {programs()} XLA programs, {hits()} read from the compile cache, "
                       f"{stored()} read back from jax_cache/executables")
    return out


def _with_policy(req: Request, target: Target, drafter: Drafter, state, run, streaming: bool) -> tuple[Request, dict]:
    """``req`` with ``params.depth`` set for ``n_max="auto"`` (:func:`dflash_jax.costs.adaptive_params`:
    the costs given, kept on disk for this machine, pair and batch size, or measured once with
    ``run`` on copies of the initial ``state`` whose rows it sets to a fixed length, before the
    prompts are prefilled), and the statistics that say where the costs came from."""
    if not req.static.adaptive:
        return req, {}

    def steps(params, s):  # streaming compiles one step: run it until the rows are done
        while not bool(jax.device_get(jnp.all(s.done))):
            s = run(params, s)
        return s

    key = costs.cost_key(req.static, req.params, len(req.prompts), (target.source, drafter.source))
    params, model = costs.adaptive_params(req.params, req.static, req.calibration, steps if streaming else run, key, state, req.cost_model)
    info = model.info or {}
    return dataclasses.replace(req, params=params), dict(
        cost_model=info.get("source", "given"), cost_model_s=info.get("seconds", 0.0) if info.get("source") == "measured" else 0.0,
        cost_widths=list(model.widths), step_cost_ms=[round(1000 * c, 3) for c in model.step_cost[0]],
        plain_cost_ms=round(1000 * model.plain_cost[0], 3))


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

    for state, toks, counts in decode.stream(req.params, state, req.static, step=step):
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
    state = decode.init_state(req.static, req.prompts, req.max_len, req.max_new_tokens, req.stop_ids, req.seed, req.sampling)
    return state if target.mesh is None else sharding.shard_state(state, target.mesh)


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
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
    decoding without.

    Args:
      target: from :func:`~dflash_jax.loading.load_target`.
      prompts: ``B`` lists of token ids (lengths may differ); rows may also be 1-D integer numpy
        or JAX arrays, or the whole batch one ``[B, P]`` integer array.
      max_new_tokens: new-token budget per row (>= 1).
      sampling: :class:`~dflash_jax.sampling.SamplingConfig` (default greedy).
      max_len: capacity per row, prompt included; default: the smallest of ``1024 * 2**k``
        holding the longest prompt + ``max_new_tokens`` (capped at the target's ``max_position_embeddings``, which
        neither may exceed). A row that fills it finishes with ``"capacity"``.
      chunk_size: prompt tokens per prefill pass (capped, see :func:`~dflash_jax.arguments.effective_chunk_size`).
      stop_ids: extra token ids that end a row (kept in the output); ignore_eos: do not stop at EOS.
      stop: stop texts (see :mod:`dflash_jax.api` for how they are applied).
      seed: sampling seed in ``[0, 2**63)``; row ``b`` uses ``fold_in(key(seed), b)`` (:mod:`~dflash_jax.sampling`).
      on_tokens: streaming callback, called with ``B`` lists of the ids each row committed since the
        previous call (the first carries prefill's token); decoding is then stepped from Python.
      drafter: a :class:`~dflash_jax.loading.Drafter` for DFlash speculative decoding (``None``:
        plain decoding). Stats then add ``tau`` (tokens per verify step, bonus included), ``verify_steps``,
        ``accepted_per_position``, ``drafted_tokens``, ``accepted_tokens`` and ``tree``.
      n_max: drafted tokens verified per step, or ``"auto"``: each step chooses the width, or a
        plain step, from calibrated confidences and measured costs (:mod:`dflash_jax.speculative.depth`;
        stats add ``widths``, ``plain_steps`` (counted as verify steps) and the costs used). Default: the drafter's recorded
        ``n_max`` (``"auto"`` for the shipped drafter), else its ``block_size - 1``.
      draft_mode: ``"argmax"`` (default) or ``"sample"`` proposals (:class:`dflash_jax.decoding.Decoding`).
      cost_model: under ``"auto"``: ``None`` (kept on disk for this device, pair and batch
        size, else measured before the timed decode), ``"refresh"`` or a ``CostModel``.
      tree: ``N``: verify a best-first tree of ``N`` drafted nodes per step (:mod:`~dflash_jax.speculative.tree`);
        ``0``: a chain; ``None``: the drafter's recorded tree (:func:`~dflash_jax.arguments.drafter_decoding`).
    Returns:
      :class:`~dflash_jax.results.GenerationResult`.
    Raises:
      DFlashError: bad prompts (non-integer or out-of-vocabulary ids), a prompt that does not fit
        ``max_len``, bad sizes, a capacity beyond the target's ``max_position_embeddings``, stop
        texts without a tokenizer, or an argument of the wrong type (the message names it).
    """
    req = check_request(target, prompts, max_new_tokens, sampling, max_len, chunk_size, stop_ids, stop, ignore_eos, seed,
                        on_tokens, drafter, n_max, draft_mode, cost_model, tree)
    state = _initial_state(req, target)
    t0 = time.perf_counter()
    prefill_c, run = _compile_reported(req, state, streaming=on_tokens is not None)  # traces shapes only; nothing runs
    compile_s = time.perf_counter() - t0
    req, policy_stats = _with_policy(req, target, drafter, state, run, streaming=on_tokens is not None)

    jax.block_until_ready((req.params, state))
    t0 = time.perf_counter()
    state = decode.prefill(req.params, state, req.static, req.chunk_size, max(len(p) for p in req.prompts), compiled=prefill_c)
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - t0

    t0, callback_s = time.perf_counter(), 0.0
    if on_tokens is None:
        state = run(req.params, state)
    else:
        state, callback_s = _stream(req, target.tokenizer, state, run, on_tokens)
    jax.block_until_ready(state)
    decode_s = time.perf_counter() - t0 - callback_s

    timings = dict(compile_time_s=compile_s, prefill_time_s=prefill_s, decode_time_s=decode_s)
    extra = dict(mode="plain") if drafter is None else dict(mode="dflash", **spec_stats(state, n_max=req.static.n_max), tree=req.static.tree, **policy_stats)
    return build_result(target, req.prompts, state, req.stop_texts, timings, max_len=req.max_len, chunk_size=req.chunk_size, **extra)
