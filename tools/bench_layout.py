"""Weight layout of the target's matmuls against pass width: ``[in, out]`` (today) or ``[out, in]``.

A verify pass runs the target over ``w + 1`` tokens; XLA:CPU may multiply a few rows faster with
the weight as the left operand (``W @ x.T``, weight stored ``[out, in]``) than as the right one
(``x @ W``, ``[in, out]``). This measures it on the real model's shapes (the loaded target's
config, random weights: the time does not depend on the values), per pass width ``T = 1..8``:

- ``chain``: every matmul of a whole pass in order (per layer ``wq wk wv wo`` then
  ``gate up down``, with residual adds so each depends on the last; the attention itself, norms
  and rope are left out, they do not touch weights), then the LM head, one separate array per
  layer as the per-layer layout holds them;
- each kind alone (``L`` independent products of that shape).

Both layouts of each program are timed alternately in one process, the median of ``--repeats``
rounds counts; the ratio ``[in,out] / [out,in]`` above 1 means the transposed layout is faster.
The LM head of a tied embedding is already ``[out, in]`` (``embed [V, H]``).

``--passes`` times what a step runs instead: the loaded default target's whole forward
(:func:`dflash_jax.families.dense.model.forward`, per-layer weights, a donated KV cache at ``--capacity``)
over ``B x T`` tokens, without and with the ``[out, in]`` copies of
:mod:`dflash_jax.nn.params` (gate/up, the LM head, both), plus a control that runs the weights
without copies again (the same program: its ratio shows the run's noise and any order effect). The
variants rotate their order every round.
Results go to sections of ``BENCHMARKS.md``::

    python tools/bench_layout.py            # about 3 minutes on 2 cores
    python tools/bench_layout.py --passes   # about 4 minutes
    python tools/bench_layout.py --widths 1,2,4 --repeats 5 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, publish  # noqa: E402


def shapes(cfg) -> dict:
    """``kind -> (in, out, count)`` of the dense target's matmuls (``count`` per pass)."""
    h, q, kv, i, n = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size, cfg.num_hidden_layers
    return {"wq": (h, q, n), "wk/wv": (h, kv, 2 * n), "wo": (q, h, n), "gate/up": (h, i, 2 * n), "down": (i, h, n),
            "lm_head": (h, cfg.vocab_size, 1)}


def weights(cfg, transposed: bool, rng):
    """Per-layer weight dicts and the LM head, random float32, ``[in, out]`` or ``[out, in]``."""
    import jax.numpy as jnp

    def w(i, o):
        a = rng.standard_normal((i, o), dtype="float32") * 0.02
        return jnp.asarray(a.T.copy() if transposed else a)

    s = shapes(cfg)
    layers = [dict(wq=w(*s["wq"][:2]), wk=w(*s["wk/wv"][:2]), wv=w(*s["wk/wv"][:2]), wo=w(*s["wo"][:2]),
                   gate=w(*s["gate/up"][:2]), up=w(*s["gate/up"][:2]), down=w(*s["down"][:2])) for _ in range(cfg.num_hidden_layers)]
    return layers, w(*s["lm_head"][:2])


def matmul(x, w, transposed: bool):
    """``x [T, in]`` times a weight held ``[in, out]`` or ``[out, in]``: ``[T, out]``."""
    import jax.numpy as jnp

    return jnp.einsum("oi,ti->to", w, x) if transposed else x @ w


def chain_fn(transposed: bool):
    """The whole pass's matmuls in order, jitted (``x [T, H]`` -> logits summed)."""
    import jax

    def f(x, layers, head):
        for lp in layers:
            q, k, v = (matmul(x, lp[n], transposed) for n in ("wq", "wk", "wv"))
            x = x + matmul(q + 0.0 * (k.sum() + v.sum()), lp["wo"], transposed)
            g, u = matmul(x, lp["gate"], transposed), matmul(x, lp["up"], transposed)
            x = x + matmul(jax.nn.silu(g) * u, lp["down"], transposed)
        return matmul(x, head, transposed).sum()

    return jax.jit(f)


def kind_fn(transposed: bool):
    """``count`` independent products of one shape, jitted."""
    import jax

    def f(x, ws):
        return sum(matmul(x, w, transposed).sum() for w in ws)

    return jax.jit(f)


def timed(f, *args) -> float:
    import jax

    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t


def measure(cfg, widths, repeats, rng) -> dict:
    """``{program: {T: (seconds [in,out], seconds [out,in])}}``, medians of alternating runs."""
    import jax.numpy as jnp

    layouts = {False: weights(cfg, False, rng), True: weights(cfg, True, rng)}
    h = cfg.hidden_size
    out = {}
    programs = {"chain": (chain_fn(False), chain_fn(True), lambda t: (layouts[t][0], layouts[t][1]), h)}
    for kind, (i, o, count) in shapes(cfg).items():
        def ws(t, kind=kind):
            a = layouts[t]
            pick = {"wq": [lp["wq"] for lp in a[0]], "wk/wv": [lp[n] for lp in a[0] for n in ("wk", "wv")],
                    "wo": [lp["wo"] for lp in a[0]], "gate/up": [lp[n] for lp in a[0] for n in ("gate", "up")],
                    "down": [lp["down"] for lp in a[0]], "lm_head": [a[1]]}[kind]
            return (pick,)
        programs[kind] = (kind_fn(False), kind_fn(True), ws, i)
    for name, (f_io, f_oi, args, width_in) in programs.items():
        out[name] = {}
        for t in widths:
            x = jnp.asarray(rng.standard_normal((t, width_in), dtype="float32"))
            a_io, a_oi = (x, *args(False)), (x, *args(True))
            timed(f_io, *a_io), timed(f_oi, *a_oi)  # compile
            io, oi = [], []
            for _ in range(repeats):
                io.append(timed(f_io, *a_io))
                oi.append(timed(f_oi, *a_oi))
            out[name][t] = (statistics.median(io), statistics.median(oi))
        print(name, " ".join(f"T{t}: {a * 1e3:.2f}/{b * 1e3:.2f}" for t, (a, b) in out[name].items()), flush=True)
    return out


def section(res, widths, argv, when) -> str:
    m = machine()
    head = "| program | " + " | ".join(f"T={t}" for t in widths) + " |"
    lines = [head, "|---|" + "---|" * len(widths)]
    for name, row in res.items():
        cells = [f"{a * 1e3:.2f} / {b * 1e3:.2f} ms (**{a / b:.2f}**)" for a, b in (row[t] for t in widths)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    chain = res["chain"]
    one = chain[widths[0]][0]
    growth = ", ".join(f"T={t}: {min(chain[t]) / one:.2f}x" for t in widths)
    kinds = [k for k in res if k != "chain"]
    mixed = ", ".join(f"T={t}: {sum(res[k][t][0] for k in kinds) * 1e3:.1f} -> {sum(min(res[k][t]) for k in kinds) * 1e3:.1f} ms"
                      f" ({1 - sum(min(res[k][t]) for k in kinds) / sum(res[k][t][0] for k in kinds):.0%} less)" for t in widths)
    wide = [t for t in widths if t > 1]
    favour = "; ".join(f"{k} {statistics.median(res[k][t][0] / res[k][t][1] for t in wide):.2f}" for k in kinds)
    return f"""## Weight layout against pass width (`tools/bench_layout.py`)

`{shlex.join(['python', 'tools/bench_layout.py', *argv])}` ({when}); the default target's shapes
(SmolLM2-135M-Instruct), float32, random weights, one array per layer. Each cell: `[in, out]` / `[out, in]`
milliseconds (medians of alternating runs) and, bold, their ratio (above 1: the transposed layout is faster).
`chain` is every matmul of one target pass over `T` tokens in order; the other rows are one kind of weight alone.

{chr(10).join(lines)}

A pass over `T` tokens against one token, the better layout each (chain): {growth}.
Every kind in its faster layout against all `[in, out]` (sums of the kind rows): {mixed}.
Median ratio over `T` = {", ".join(map(str, wide))} per kind (above 1: `[out, in]` faster): {favour}.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""


PASS_SHAPES = ((1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (8, 1), (8, 2), (8, 4))


def measure_passes(target, shapes_bt, repeats, capacity, rng) -> dict:
    """``{(B, T): {variant: seconds}}``: medians of the whole target forward per variant, the
    variants' order rotating every round; also checks each variant's logits against those
    without copies (float32 tolerance, equal argmax) and raises ``AssertionError`` otherwise."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.families.dense import model as dense
    from dflash_jax.nn import params as layouts

    p = layouts.canonical(target.params)
    variants = {"no copies": p, "control": p, "gate/up": layouts.with_wide_layouts(p, ("gate_up",)),
                "lm head": layouts.with_wide_layouts(p, ("lm_head",)), "both": layouts.with_wide_layouts(p)}

    def fwd(params, tokens, positions, cache):
        logits, cache, _ = dense.MODEL.forward(params, target.cfg, tokens, positions, cache)
        return logits, cache

    f = jax.jit(fwd, donate_argnums=3)
    out = {}
    for b, t in shapes_bt:
        cache = dense.MODEL.init_cache(target.cfg, b, capacity)
        tokens = jnp.asarray(rng.integers(0, 1000, (b, t)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(capacity // 2, capacity // 2 + t, dtype=jnp.int32), (b, t))
        ref = None
        for name, params in variants.items():  # compile, and the values
            logits, cache = f(params, tokens, positions, cache)
            ref = logits if ref is None else ref
            np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=1e-3, atol=5e-2, err_msg=name)
            assert bool(jnp.all(jnp.argmax(logits, -1) == jnp.argmax(ref, -1))), name
        times = {name: [] for name in variants}
        names = list(variants)
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                logits, cache = f(variants[name], tokens, positions, cache)
                jax.block_until_ready(logits)
                times[name].append(time.perf_counter() - t0)
        out[(b, t)] = {name: statistics.median(v) for name, v in times.items()}
        print(f"B={b} T={t}", " ".join(f"{k} {v * 1e3:.1f}" for k, v in out[(b, t)].items()), flush=True)
    return out


def passes_section(res, argv, when, capacity) -> str:
    m = machine()
    names = list(next(iter(res.values())))
    lines = ["| B x T | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for (b, t), row in res.items():
        base = row["no copies"]
        lines.append(f"| {b} x {t} | " + " | ".join(f"{v * 1e3:.1f} ms" + ("" if k == "no copies" else f" (**{base / v:.2f}**)")
                                                    for k, v in row.items()) + " |")
    return f"""## Weight layout in a whole target pass (`tools/bench_layout.py --passes`)

`{shlex.join(['python', 'tools/bench_layout.py', *argv])}` ({when}); the default target
(SmolLM2-135M-Instruct Q4_1 in float32), per-layer weights, a donated KV cache of {capacity} slots, the pass at
position {capacity // 2}. Each cell: the median milliseconds of one forward over `B x T` tokens and, bold, the time
without copies over the variant's (above 1: the variant is faster). `control` runs the weights without copies again:
its ratio is the run's noise and order effect. The variants add `[out, in]` copies (`dflash_jax.nn.params`) used
from 2 rows (`B x T`) on for gate/up and from 3 rows on for the LM head; every variant's logits match those without
copies (float32 tolerance, same argmax).

{chr(10).join(lines)}

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="1,2,3,4,5,6,8", help="pass widths T (tokens per target pass)")
    p.add_argument("--repeats", type=int, default=15, help="alternating runs per layout and width; the median counts")
    p.add_argument("--passes", action="store_true", help="time the whole target forward with and without the [out, in] copies instead")
    p.add_argument("--capacity", type=int, default=512, help="KV cache slots of --passes")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    import numpy as np

    from dflash_jax.loading import load_target

    widths = [int(t) for t in args.widths.split(",")]
    target = load_target()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.passes:
        text = passes_section(measure_passes(target, PASS_SHAPES, args.repeats, args.capacity, np.random.default_rng(0)),
                              sys.argv[1:] if argv is None else argv, when, args.capacity)
        publish(text, args, "layout_pass", "bench_layout")
        return 0
    cfg = target.cfg
    res = measure(cfg, widths, args.repeats, np.random.default_rng(0))
    text = section(res, widths, sys.argv[1:] if argv is None else argv, when)
    publish(text, args, "layout", "bench_layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
