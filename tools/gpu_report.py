"""The BENCHMARKS.md section of a tools/gpu_check.py run, written from its results dict."""

from __future__ import annotations

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
        f"real shapes (`tools/gpu_shapes.py`), batch 1, capacity {params.get('capacity', '?')}, the on-device decode loop "
        "compiled ahead of time as `generate` does; each figure is the median of several runs after a warm-up.",
        "### Oracle tests on the device", _oracle(results),
        "### Mesh", _mesh(results),
        "### Decode step and HBM bandwidth", _decode(results),
        "### Decode step against live length", _scaling(results),
        "### Verify cost", _verify(results),
        "### DFlash tokens/s against acceptance", _dflash(results),
        "### Compile times", _compile(results),
    ]
    if skipped:
        parts.append("Skipped: " + "; ".join(skipped) + ".")
    return "\n\n".join(parts) + "\n"
