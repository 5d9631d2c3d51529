"""Timed measurements behind tools/gpu_check.py, and the BENCHMARKS.md section written from its
results (:func:`markdown`).

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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import loop as decode
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.families.registry import module_for
from dflash_jax.decode.step import commit_block
from dflash_jax.decode.step import propose_fn
from dflash_jax.decode.tree import propose_tree_fn, verify_tree_fn
from dflash_jax.decode.step import verify_fn

from dflash_jax.shapes import kv_bytes_live, weight_bytes_per_token

REPO = Path(__file__).resolve().parents[1]


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


# ---- the BENCHMARKS.md section of a run (was tools/gpu_report.py)

GOAL_HBM = 0.60  # decode of the Qwen3-8B shape in bf16: at least this fraction of HBM bandwidth
GOAL_VERIFY16 = 1.3  # a verify pass over 16 tokens: at most this many single-token passes
HEADLINE = ("qwen3-8b", "bfloat16")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _runs(results: dict, key: str):
    return [r for r in results.get("runs", []) if r.get(key)]


def _decode(results: dict) -> str:
    rows, goal = [], "not measured"
    for r in _runs(results, "decode"):
        d = r["decode"][0]
        rows.append([r["shape"], r["dtype"], d["live"], _gb(d["weight_bytes"]), _gb(d["kv_bytes"]), f"{d['step_ms']:.3f}",
                     f"{d['tokens_per_s']:.1f}", f"{d['bytes_per_s'] / 1e12:.2f}", f"**{100 * d['hbm_fraction']:.0f}%**",
                     f"{100 * d['bytes_per_s'] / results['copy_bandwidth']['bytes_per_s']:.0f}%", f"{d['prefill_tokens_per_s']:.0f}"])
        if (r["shape"], r["dtype"]) == HEADLINE:
            ok = d["hbm_fraction"] >= GOAL_HBM
            goal = f"{'met' if ok else 'NOT met'} ({100 * d['hbm_fraction']:.0f}%)"
    head = ["target", "dtype", "live", "weights GB/step", "KV GB/step", "step ms", "tok/s", "TB/s", "of peak",
            "of copy", "prefill tok/s (1 run)"]
    return (_table(head, rows) + f"\n\nGoal, decode of the Qwen3-8B shape in bf16 at >= {GOAL_HBM:.0%} of HBM bandwidth: **{goal}**. "
            "Bytes per step: every weight once (a MoE: only the top-k experts; untied embeddings: one row), plus the K/V of "
            "the live positions (sliding layers: the window); 'of peak' divides by the peak named above, 'of copy' by the "
            "copy bandwidth of this run.")


def _scaling(results: dict) -> str:
    runs = [r for r in _runs(results, "decode") if len(r["decode"]) > 1]
    if not runs:
        return "Not measured."
    lengths = sorted({d["live"] for r in runs for d in r["decode"]})
    rows = []
    for r in runs:
        ms = {d["live"]: d["step_ms"] for d in r["decode"]}
        rows.append([r["shape"], r["dtype"]] + [f"{ms[n]:.3f}" if n in ms else "" for n in lengths])
    return (_table(["target", "dtype"] + [f"live {n}" for n in lengths], rows)
            + f"\n\nDecode step ms at each live length, capacity {runs[0]['capacity']}: a step that follows the live "
            "length grows along a row; one that reads the whole capacity stays flat.")


def _verify(results: dict) -> str:
    runs = _runs(results, "verify")
    if not runs:
        return "Not measured."
    widths = sorted({v["width"] for r in runs for v in r["verify"]})
    rows, goal = [], "not measured"
    for r in runs:
        ms = {v["width"]: v["ms"] for v in r["verify"]}
        one = ms.get(1)
        step = next((d["step_ms"] for d in r["decode"] if d["live"] == r["verify"][0]["context"]), None)
        vs_step = ms[16] / step if step and 16 in ms else None
        rows.append([r["shape"], r["dtype"], f"{one:.3f}" if one else "", f"{step:.3f}" if step else "",
                     f"**{vs_step:.2f}**" if vs_step else ""] + [f"{ms[w] / one:.2f}" if one and w in ms else "" for w in widths])
        if (r["shape"], r["dtype"]) == HEADLINE and vs_step:
            goal = f"{'met' if vs_step <= GOAL_VERIFY16 else 'NOT met'} ({vs_step:.2f}x)"
    head = ["target", "dtype", "B=1 ms", "decode step ms", "B=16 / decode step"] + [f"B={w} / B=1" for w in widths]
    return (_table(head, rows) + "\n\nOne target pass (layers and LM head, as a verify makes) over B tokens after the "
            "headline live length, against one pass over 1 token and against one step of the decode loop. "
            f"Goal, B = 16 on the Qwen3-8B shape in bf16 at most {GOAL_VERIFY16}x a decode step: **{goal}**.")


def _dflash(results: dict) -> str:
    rows = []
    for r in _runs(results, "dflash"):
        for d in r["dflash"]:
            drafts = f"tree of {d['tree']}" if d.get("tree") else r["block_size"] - 1
            rows.append([r["shape"], r["dtype"], drafts, d["accept"], f"{d['acceptance_rate']:.2f}", f"{d['tau']:.2f}",
                         f"{d['step_ms']:.3f}", f"{d['step_in_decode_steps']:.2f}", f"{d['tokens_per_s']:.1f}", f"**{d['speedup']:.2f}x**"])
    if not rows:
        return "Not measured."
    head = ["target", "dtype", "n_max (or tree nodes)", "accepted/step", "acceptance rate", "tau", "step ms", "step / decode step",
            "tok/s", "vs plain"]
    return (_table(head, rows) + "\n\nDFlash steps of fixed acceptance (the drafter's propose and the target's verify "
            "run as in a real step; the verdict accepts exactly that many drafts), batch 1, from the headline live length. "
            "A tree row drafts a best-first tree of that many nodes over the drafter's whole block and verifies it in one "
            "pass of nodes + 1 tokens: its step cost against the chain's is what tree verification costs on the device.")


def _compile(results: dict) -> str:
    rows = [[r["shape"], r["dtype"], f"{r.get('init_s', 0):.1f}", ", ".join(f"{k} {v:.1f}" for k, v in r["compile_s"].items())]
            for r in _runs(results, "compile_s")]
    return _table(["target", "dtype", "random weights s", "compile s (lowering included)"], rows) if rows else "Not measured."


def _mesh(results: dict) -> str:
    m = results.get("mesh")
    if not m:
        return "Not run."
    if m.get("error"):
        return f"A mesh over {m['devices']} device(s) failed: `{m['error']}`."
    same = "the same tokens as one device" if m["same_tokens"] else "**other tokens than one device**"
    return f"`generate` (plain and DFlash, greedy, a tiny model) on a mesh of {m['mesh']} runs and gives {same} ({m['seconds']:.1f} s)."


def _oracle(results: dict) -> str:
    o = results.get("oracle_tests")
    if not o:
        return "Not run."
    end = "stopped at its time bound" if o["timed_out"] else f"exit code {o['returncode']}"
    text = (f"`python {o['command']}` on the device: **{o['passed']} passed, {o['failed']} failed**, {o['skipped']} skipped "
            f"in {o['seconds']:.0f} s ({end}; log: `{o['log']}`).")
    return text + ("\nFailed: " + ", ".join(f"`{f}`" for f in o["failures"]) if o["failures"] else "")


def _memory(results: dict) -> str:
    """Device memory of each model's weights (quantized entries keep their codes: ``"<shape> <scheme>"``)."""
    rows = [[r["shape"], r["dtype"], f"{r['weights_bytes'] / 1e9:.2f}", f"{r['drafter_bytes'] / 1e9:.2f}"]
            for r in results.get("runs", []) if "weights_bytes" in r]
    return _table(["model", "dtype", "target weights GB", "drafter weights GB"], rows) if rows else "not measured"


def markdown(results: dict) -> str:
    """The section (Markdown, without its BENCHMARKS.md markers) for the results of one run."""
    dev, m = results.get("device", {}), results.get("machine", {})
    cb = results.get("copy_bandwidth")
    copy = f"{cb['bytes_per_s'] / 1e12:.2f} TB/s (read + written, elementwise pass over {cb['bytes'] / 2**30:.2f} GiB)" if cb else "not measured"
    skipped = [f"{r['shape']} {r['dtype']}: {s}" for r in results.get("runs", []) for s in r.get("skipped", [])]
    runs = [r for r in results.get("runs", []) if r.get("decode")]
    params = runs[0] if runs else {}
    parts = [
        f"## DFlash on a GPU: {dev.get('device_kind', '?')} ({results.get('mode')})",
        f"`{results.get('command')}` ({results.get('date')}, {results.get('elapsed_s', 0):.0f} s of a {results.get('budget_s', 0):.0f} s budget); "
        f"backend {dev.get('backend')}, {dev.get('nvidia_smi') or m.get('cpu')}; jax {m.get('jax')}, Python {m.get('python')}.",
        f"Copy bandwidth in this run: {copy}. Peak for 'of peak': {results.get('peak_source', '?')}. Random weights of the "
        f"real shapes (`dflash_jax/shapes.py`), batch 1, capacity {params.get('capacity', '?')}, the on-device decode loop "
        "compiled ahead of time as `generate` does; each figure is the median of several runs after a warm-up.",
        "### Oracle tests on the device", _oracle(results),
        "### Mesh", _mesh(results),
        "### Weights in device memory", _memory(results),
        "### Decode step and HBM bandwidth", _decode(results),
        "### Decode step against live length", _scaling(results),
        "### Verify cost", _verify(results),
        "### DFlash tokens/s against acceptance", _dflash(results),
        "### Compile times", _compile(results),
    ]
    if skipped:
        parts.append("Skipped: " + "; ".join(skipped) + ".")
    return "\n\n".join(parts) + "\n"
