"""Timed measurements behind tools/gpu_check.py.

Everything runs the package's own jitted steps, compiled ahead of time as ``dflash_jax.generate``
compiles them (``decode.compile_prefill``, ``decode.generate_until``), so the figures are those of
what users run. Times are medians of several runs after a warm-up, each run on a fresh copy of a
prefilled state (the steps donate it), synchronised with ``jax.block_until_ready`` around the
clock. A DFlash step of *fixed acceptance* (:func:`fixed_acceptance_step`) runs the drafter's
propose and the target's verify pass as a real step does, then accepts exactly ``accept`` drafts,
so tokens/s can be read against the acceptance rate on random weights.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import loop as decode
from dflash_jax.decode.static import Decoding, Params
from dflash_jax.families.registry import module_for
from dflash_jax.decode.step import commit_block
from dflash_jax.decode.step import propose_fn
from dflash_jax.decode.tree import propose_tree_fn, verify_tree_fn
from dflash_jax.decode.step import verify_fn

from gpu_shapes import REPO, kv_bytes_live, weight_bytes_per_token


def fixed_acceptance_step(params: Params, state, static: Decoding, accept):
    """One DFlash step (propose -> verify -> commit, as :func:`dflash_jax.decode.loop.speculative_step_fn`)
    whose verdict accepts exactly ``accept`` drafts per row (``[]`` int32, at most what the block
    allows): the drafter's and the target's passes run as in a real step, so it costs what a real
    step costs, while the acceptance is scripted (the committed tokens are not the target's). With
    ``static.tree`` the step drafts and verifies a best-first tree and moves the accepted path's
    rows as a tree step does."""
    if static.tree:
        tree, _ = propose_tree_fn(params, state, static)
        verdict = verify_tree_fn(params, state, static, tree)
    else:
        drafts, _ = propose_fn(params, state, static)
        verdict = verify_fn(params, state, static, drafts)
    a = jnp.minimum(jnp.broadcast_to(jnp.asarray(accept, jnp.int32), verdict.accepted.shape),
                    jnp.minimum(verdict.n_valid, verdict.tokens.shape[1] - 1))
    return commit_block(params, state, static, verdict._replace(accepted=a))


def _fixed_acceptance_loop(params: Params, state, static: Decoding, accept):
    """:func:`fixed_acceptance_step` on device until every row is done (``decode.steps_until``)."""
    return decode.steps_until(lambda s: fixed_acceptance_step(params, s, static, accept), state, state.tokens.shape[0])


fixed_acceptance_loop = jax.jit(_fixed_acceptance_loop, static_argnames=("static",), donate_argnames=("state",))


def fresh(state):
    """A copy of every array of ``state`` (the timed steps donate their input)."""
    return jax.tree_util.tree_map(lambda x: x.copy(), state)


def clocked(fn):
    """``(fn(), seconds)`` with the result ready on the device before the clock stops."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def median_run(run, state, repeats: int):
    """Median seconds of ``run(fresh(state))`` over ``repeats`` runs after one warm-up; returns
    ``(seconds, last output)``."""
    out = jax.block_until_ready(run(fresh(state)))
    times = []
    for _ in range(repeats):
        s = jax.block_until_ready(fresh(state))
        out, dt = clocked(lambda: run(s))
        times.append(dt)
    return statistics.median(times), out


class Generation:
    """Prefill and an on-device decode loop compiled for one model, set-up and capacity (batch 1).

    ``loop(params, state, arg)`` is ``decode.generate_until`` (plain, ``arg`` = rows to finish) or
    :data:`fixed_acceptance_loop` (DFlash, ``arg`` = drafts accepted per step). ``compile_s``
    holds each program's lowering plus compilation seconds.
    """

    def __init__(self, params: Params, static: Decoding, capacity: int, chunk: int):
        self.params, self.static, self.capacity, self.chunk = params, static, capacity, chunk
        state = decode.init_state(static, [[1]], capacity, 1)
        self.compile_s = {}
        self.prefill_c, self.compile_s["prefill"] = clocked(lambda: decode.compile_prefill(params, state, static, chunk))
        jitted = fixed_acceptance_loop if static.speculative else decode.generate_until
        self.loop, self.compile_s["loop"] = clocked(lambda: jitted.lower(params, state, static, jnp.int32(1)).compile())

    def prefilled(self, prompt_len: int, max_new: int, seed: int = 0):
        """``(state, seconds)``: a random prompt of ``prompt_len`` tokens prefilled, ``max_new`` budget."""
        prompt = np.random.RandomState(seed).randint(0, self.static.target.vocab_size, prompt_len).tolist()
        state = jax.block_until_ready(decode.init_state(self.static, [prompt], self.capacity, max_new))
        return clocked(lambda: decode.prefill(self.params, state, self.static, self.chunk, prompt_len, compiled=self.prefill_c))

    def run(self, state, arg: int, repeats: int) -> dict:
        """Times the loop from ``state``: median seconds, steps, tokens committed (per row)."""
        seconds, out = median_run(lambda s: self.loop(self.params, s, jnp.int32(arg)), state, repeats)
        steps = int(out.steps) - int(state.steps)
        tokens = int(out.length[0]) - int(state.length[0])
        return dict(seconds=seconds, steps=steps, tokens=tokens)


def decode_at(gen: Generation, cfg, live: int, steps: int, repeats: int, peak_bw: float) -> dict:
    """Plain decode from a prompt of ``live`` tokens: step time and the fraction of ``peak_bw``
    (bytes/s) that the weights plus the live K/V read per step reach."""
    state, prefill_s = gen.prefilled(live, steps + 1)
    r = gen.run(state, 1, repeats)
    step_s = r["seconds"] / r["steps"]
    weights = weight_bytes_per_token(gen.params.target, cfg)
    window = getattr(cfg, "sliding_window", 0)
    kv = kv_bytes_live(state.cache, gen.capacity, live + steps // 2, window)
    bw = (weights + kv) / step_s
    return dict(live=live, steps=r["steps"], step_ms=1e3 * step_s, tokens_per_s=1 / step_s, weight_bytes=weights,
                kv_bytes=kv, bytes_per_s=bw, hbm_fraction=bw / peak_bw, prefill_tokens_per_s=live / prefill_s)


def dflash_at(gen: Generation, live: int, accept: int, steps: int, repeats: int, plain_step_ms: float) -> dict:
    """DFlash decoding of fixed acceptance from a prompt of ``live`` tokens: tokens/s, tau and the
    step's cost in plain decode steps."""
    state, _ = gen.prefilled(live, 1 + steps * (accept + 1))
    r = gen.run(state, accept, repeats)
    step_ms = 1e3 * r["seconds"] / r["steps"]
    tps = r["tokens"] / r["seconds"]
    return dict(accept=accept, acceptance_rate=accept / gen.static.n_max, tau=r["tokens"] / r["steps"], steps=r["steps"],
                step_ms=step_ms, step_in_decode_steps=step_ms / plain_step_ms, tokens_per_s=tps,
                speedup=tps * plain_step_ms / 1e3, tree=gen.static.tree)


def verify_cost(params, cfg, capacity: int, live: int, width: int, calls: int, repeats: int) -> dict:
    """One target pass (layers and LM head, the pass a verify makes) over ``width`` tokens after
    ``live`` cached positions: median seconds per pass over ``calls`` passes back to back (cache
    donated, so no copy of it is timed), and its compile seconds."""
    mod = module_for(cfg)

    def fwd(p, cache, toks, pos):
        h, cache, _ = mod.forward_hidden(p, cfg, toks, pos, cache)
        return mod.lm_head(p, cfg, h), cache

    cache = random_like(mod.init_cache(cfg, 1, capacity))
    toks = jnp.asarray(np.random.RandomState(width).randint(0, cfg.vocab_size, (1, width)), jnp.int32)
    pos = live + jnp.arange(width, dtype=jnp.int32)[None]
    step, compile_s = clocked(lambda: jax.jit(fwd, donate_argnums=(1,)).lower(params, cache, toks, pos).compile())

    def run(c):
        for _ in range(calls):
            _, c = step(params, c, toks, pos)
        return c

    cache = jax.block_until_ready(run(cache))
    times = []
    for _ in range(repeats):
        cache, dt = clocked(lambda: run(cache))
        times.append(dt / calls)
    return dict(width=width, context=live, ms=1e3 * statistics.median(times), compile_s=compile_s)


def random_like(tree, seed: int = 0):
    """``tree`` with every float array replaced by random normal values (never time on zeros)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
           for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def copy_bandwidth(nbytes: int, repeats: int) -> dict:
    """Device memory bandwidth: bytes read plus written per second by an elementwise pass over
    ``nbytes`` of random float32 (the ceiling the decode figures are read against)."""
    x = jax.random.normal(jax.random.key(1), (nbytes // 4,), jnp.float32)
    double = jax.jit(lambda a: a * 2.0).lower(x).compile()
    seconds, _ = median_run(lambda s: double(s), x, repeats)
    return dict(bytes=nbytes, seconds=seconds, bytes_per_s=2 * nbytes / seconds)


def oracle_tests(files, expr: str, timeout_s: float, backend: str, log_path) -> dict:
    """Runs ``pytest files -k expr`` (the suite's oracle tests) in a subprocess on ``backend``,
    stopped after ``timeout_s``; counts PASSED/FAILED/ERROR/SKIPPED lines and writes the log."""
    platform = "cuda" if backend == "gpu" else backend
    env = dict(os.environ, JAX_PLATFORMS=platform, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "pytest", *files, "-k", expr, "-m", "not slow", "-o", "addopts=", "-v", "-rs",
           "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        out, rc, timed_out = r.stdout + r.stderr, r.returncode, False
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        rc, timed_out = None, True
    log_path.write_text(out, encoding="utf-8")
    lines = [ln for ln in out.splitlines() if ln.startswith("tests/")]
    count = {k: sum(f" {k}" in ln for ln in lines) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = [ln.split(" ")[0] for ln in lines if " FAILED" in ln or " ERROR" in ln]
    return dict(command=" ".join(cmd[1:]), seconds=time.perf_counter() - t0, returncode=rc, timed_out=timed_out,
                passed=count["PASSED"], failed=count["FAILED"] + count["ERROR"], skipped=count["SKIPPED"],
                failures=failed, log=log_path.name)


def mesh_check() -> dict:
    """Whether the mesh path (``load_target(mesh=...)``, ``--mesh``) lowers and runs on the devices
    found: a tiny random target and drafter laid out on a mesh of every device (``model`` = the
    device count: heads split where it divides them), ``dflash_jax.generate`` greedy, plain and
    DFlash, against the same generation on one device. ``{devices, mesh, runs, same_tokens,
    seconds, error}``."""
    import dflash_jax as dj
    from dflash_jax.runtime import sharding
    from dflash_jax.loading import Drafter, Target
    from dflash_jax.families.dense import model as dense
    from dflash_jax.drafter import model as drafter
    from dflash_jax.testing import tiny_drafter, tiny_target

    t0, n = time.perf_counter(), jax.device_count()
    out = dict(devices=n, mesh=None, runs=False, same_tokens=None, error=None)
    try:
        mesh = sharding.make_mesh(model=n)
        out["mesh"] = sharding.describe(mesh)
        cfg, p = tiny_target("qwen3", seed=3, num_attention_heads=8, num_key_value_heads=8)
        dcfg, dp = tiny_drafter(cfg, seed=1, num_attention_heads=8, num_key_value_heads=8)
        one, meshed = Target(cfg=cfg, params=p), Target(cfg=cfg, params=sharding.shard_params(p, dense.MODEL.param_axes(cfg), mesh), mesh=mesh)
        d_one = Drafter(cfg=dcfg, params=dp)
        d_mesh = Drafter(cfg=dcfg, params=sharding.shard_params(dp, drafter.param_axes(dcfg), mesh))
        prompts, same = [[5, 9, 17, 3], [40, 2, 7]], True
        for kw_one, kw_mesh in (({}, {}), (dict(drafter=d_one, n_max=3), dict(drafter=d_mesh, n_max=3))):
            a = dj.generate(one, prompts, max_new_tokens=16, ignore_eos=True, **kw_one).output_ids
            b = dj.generate(meshed, prompts, max_new_tokens=16, ignore_eos=True, **kw_mesh).output_ids
            same = same and a == b
        out.update(runs=True, same_tokens=same)
    except Exception as e:  # recorded, not raised: the rest of the check goes on
        out["error"] = f"{type(e).__name__}: {e}"[:600]
    out["seconds"] = time.perf_counter() - t0
    return out
