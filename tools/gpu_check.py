"""One prepared check for a lent GPU (an H200): speed of random-weight models of real shapes, and
the suite's fast oracle tests on the device. Writes one JSON and the BENCHMARKS.md section.

On the device machine (the image has jax with the CUDA plugin; nothing is installed)::

    PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --out $OUT            # under 8 minutes
    PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --quick --out $OUT    # fewer points, about half
    python tools/gpu_check.py --dry-run          # the same code, tiny shapes, on this CPU
    python tools/gpu_check.py --merge OUT/gpu_check.md   # put a fetched section into BENCHMARKS.md

Measured, for targets shaped like SmolLM2-135M, Qwen3-8B (bf16, and block-scaled FP8 as
Qwen3-8B-FP8 ships it: ``qwen3-8b-fp8``), Laguna-XS-2.1 (bf16 and Q4_K_M), Qwen3-Coder-30B-A3B,
gpt-oss-20b (bf16 and MXFP4 experts) and Qwen3.8-27B (:mod:`dflash_jax.shapes`; random weights: speed does not depend on their values) with drafters
of their real shapes (Qwen3.8-27B's: the DFlash2 drafter, its convolutions and candidate selector):

- decode step time (the on-device ``generate`` loop, batch 1) and the fraction of HBM bandwidth it
  reaches: bytes that must move per step (every weight once, only the chosen experts of a MoE, the
  live K/V rows) over the step time, against 4.3 TB/s (copy bandwidth measured on an H200 here)
  and against the copy bandwidth measured in this run;
- the same step at several live lengths in one capacity (does it follow the live length?);
- verify cost: one target pass over B tokens relative to B = 1;
- DFlash tokens/s against the acceptance rate, with a step of fixed acceptance (``gpu_measure``),
  for chains and for best-first trees of 7 and 15 nodes (tree verification: what a wider verify pass
  costs on the device);
- compile seconds of every program; bf16 and fp32;
- quantized weights kept quantized (:func:`dflash_jax.shapes.quantized_models`): Laguna-XS-2.1 in
  Q4_K_M with a Q8_0 drafter and gpt-oss-20b with its MXFP4 experts (random codes in the layout the
  GGUF loaders keep): device memory of the weights, decode and verify step times (results entry
  ``"<shape> <scheme>"``);
- the oracle tests (transformers parity, losslessness, exact sampling) with pytest on the device;
- whether the mesh path lowers and runs on the devices found (``--mesh``: a tiny model on a mesh of
  every device, its tokens against one device's).

The run keeps to a time budget: sections are done in priority order, and one that would not fit
in what is left is skipped and named in the output. Results are rewritten after every section, so
a run stopped from outside still leaves its figures in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchlib import machine, write_section  # noqa: E402
from dflash_jax.decode.state import Decoding, Params  # noqa: E402
from dflash_jax.shapes import as_fp8, configs, quantized_configs, quantized_models, random_models, tree_bytes  # noqa: E402
from gpu_measure import Generation, clocked, copy_bandwidth, decode_at, dflash_at, markdown, mesh_check, oracle_tests, verify_cost  # noqa: E402

H200_COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on an H200 of this workplace (read + written)
ORACLE_FILES = ("tests/test_parity_transformers.py", "tests/test_laguna.py", "tests/test_decode.py", "tests/test_spec.py",
                "tests/test_sampling.py")
ORACLE_EXPR = ("full_forward or chunked_prefill_then_decode or no_cache or greedy_lossless or scripted_full_acceptance "
               "or follow_target_distribution or probabilities_match_reference or sample_frequencies")


@dataclasses.dataclass(frozen=True)
class Run:
    """One model in one dtype: plain decode from prompts of ``lengths`` tokens, verify passes of
    ``widths`` tokens, DFlash steps accepting ``accepts`` drafts (capped at n_max) and tree steps
    of ``trees`` nodes accepting :data:`TREE_ACCEPT`, all after ``context`` cached tokens. Runs of one model and dtype share one entry of the results, so a
    later run can fill in points when time is left."""

    shape: str
    dtype: str
    lengths: tuple = ()
    widths: tuple = (1, 16)
    accepts: tuple = ()
    context: int = 1024
    trees: tuple = ()  # tree verification: steps over best-first trees of these many nodes, accepting TREE_ACCEPT drafts
    weights: str = ""  # "": float weights of dtype; a scheme of dflash_jax.shapes.SCHEMES: quantized ones (computing in dtype)

    @property
    def label(self) -> str:
        """The results entry's model name: the shape, and the quantization scheme when there is one."""
        return f"{self.shape} {self.weights}".strip()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Runs in priority order (one that does not fit in the budget left is skipped), the capacity
    of every state, decode steps per timed run, timed runs (median), verify passes per timed run,
    prefill chunk, bytes of the copy-bandwidth pass, the oracle tests ``(files, -k expression)``
    with their time bound, the whole run's budget in seconds, and whether the shapes are tiny."""

    runs: tuple
    capacity: int
    steps: int
    repeats: int
    calls: int
    chunk: int
    copy_bytes: int
    oracle: tuple
    oracle_s: float
    budget_s: float
    tiny: bool = False


_LEN = (1024, 128, 2048, 3968)
TREE_ACCEPT = 3  # drafts a tree step accepts: its cost against a chain's of the same acceptance
PLANS = {
    "full": Plan(runs=(Run("qwen3-8b", "bfloat16", _LEN, (1, 16, 2, 4, 8), (0, 15, 1, 3, 7), trees=(15, 7)),
                       Run("smollm2-135m", "bfloat16", _LEN, (1, 16, 2, 4, 8), (0, 7, 1, 3), trees=(7, 15)),
                       Run("qwen3-8b-fp8", "bfloat16", (1024, 2048), (1, 16, 4), (0, 15, 3)),
                       Run("laguna-xs-2.1", "bfloat16", _LEN, (1, 16, 2, 4, 8), (0, 15, 1, 3, 7)),
                       Run("qwen3-coder-30b-a3b", "bfloat16", (1024, 2048), (1, 16, 4), (0, 15, 3)),
                       Run("gpt-oss-20b", "bfloat16", (1024, 2048), (1, 16, 4), (0, 15, 3)),
                       Run("qwen3.8-27b", "bfloat16", (1024,), (1, 8), (0, 7, 3)),  # a DFlash2 drafter (block 8)
                       Run("qwen3-8b", "float32", (1024,)), Run("smollm2-135m", "float32", (1024,)),
                       Run("laguna-xs-2.1", "bfloat16", (1024,), (1, 16), (0, 15), weights="q4_k_m"),
                       Run("gpt-oss-20b", "bfloat16", (1024,), (1, 16), (0, 15), weights="mxfp4"),
                       Run("qwen3-8b", "bfloat16", widths=(12, 3, 6, 10, 14, 5, 7, 9, 11, 13, 15))),  # B = 1..16 if time is left
                 capacity=4096, steps=64, repeats=5, calls=20, chunk=512, copy_bytes=4 << 30,
                 oracle=(ORACLE_FILES, ORACLE_EXPR), oracle_s=120, budget_s=420),
    "quick": Plan(runs=(Run("qwen3-8b", "bfloat16", (1024, 1984), (1, 16, 8), (0, 15, 3), trees=(15,)),
                        Run("smollm2-135m", "bfloat16", (1024, 1984), (1, 16), (0, 7, 3), trees=(7,)),
                        Run("qwen3-8b-fp8", "bfloat16", (1024,), (1, 16), (0, 15)),
                        Run("laguna-xs-2.1", "bfloat16", (1024,), (1, 16), (0, 15)),
                        Run("qwen3-coder-30b-a3b", "bfloat16", (1024,), (1, 16), (0, 15)),
                        Run("gpt-oss-20b", "bfloat16", (1024,), (1, 16), (0, 15)), Run("qwen3-8b", "float32", (1024,)),
                        Run("qwen3.8-27b", "bfloat16", (1024,), (1, 8), (0, 7)),
                        Run("laguna-xs-2.1", "bfloat16", (1024,), (1, 16), weights="q4_k_m"),
                        Run("gpt-oss-20b", "bfloat16", (1024,), (1, 16), weights="mxfp4")),
                  capacity=2048, steps=32, repeats=3, calls=10, chunk=512, copy_bytes=2 << 30,
                  oracle=(ORACLE_FILES, ORACLE_EXPR), oracle_s=60, budget_s=240),
    # every shape kind, both dtypes, every section and a fill-in run, at toy sizes; a budget that skips nothing.
    # One tree run (qwen3-8b's): a second one (smollm2's, float32) compiled two more programs for no other code path
    "dry-run": Plan(runs=(Run("qwen3-8b", "bfloat16", (64, 200), (1,), (0, 7, 3), 64, trees=(5,)),
                          Run("laguna-xs-2.1", "bfloat16", (64,), (1,), (7,), 64),
                          Run("qwen3-8b-fp8", "bfloat16", (64,), (1,), (3,), 64),
                          Run("qwen3-coder-30b-a3b", "bfloat16", (64,), (1,), (7,), 64),
                          Run("gpt-oss-20b", "bfloat16", (64,), (1,), (7,), 64),
                          Run("qwen3.8-27b", "bfloat16", (64,), (1,), (3,), 64),
                          Run("smollm2-135m", "float32", (64,), (1,), (3,), 64), Run("qwen3-8b", "bfloat16", widths=(4,), context=64),
                          Run("laguna-xs-2.1", "bfloat16", (64,), (1,), (7,), 64, weights="q4_k_m"),
                          Run("gpt-oss-20b", "bfloat16", (64,), (1,), (7,), 64, weights="mxfp4")),
                    capacity=256, steps=8, repeats=2, calls=3, chunk=32, copy_bytes=64 << 20,
                    oracle=(("tests/test_sampling.py",), "greedy_and_gap"), oracle_s=120, budget_s=900, tiny=True),
}


class Budget:
    """Wall-clock seconds left for the run, and whether ``n`` more compilations fit (estimated by
    the slowest compilation seen so far)."""

    def __init__(self, total_s: float, first_compile_s: float):
        self.t0, self.total, self.compile_est = time.perf_counter(), total_s, first_compile_s

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)

    def saw(self, *compile_s: float) -> None:
        self.compile_est = max(self.compile_est, *compile_s)

    def fits(self, programs: int, extra_s: float = 5.0) -> bool:
        return self.left() > programs * self.compile_est + extra_s


class Report:
    """The results dict, rewritten to ``out/gpu_check.json`` and ``out/gpu_check.md`` after every section."""

    def __init__(self, out: Path, results: dict, t0: float):
        self.out, self.results, self.t0 = out, results, t0

    def save(self) -> None:
        self.results["elapsed_s"] = time.perf_counter() - self.t0
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str), encoding="utf-8")
        (self.out / "gpu_check.md").write_text(markdown(self.results), encoding="utf-8")

    def entry(self, shape: str, dtype: str, capacity: int) -> dict:
        """The results entry of one model and dtype (made on first use)."""
        for e in self.results["runs"]:
            if (e["shape"], e["dtype"]) == (shape, dtype):
                return e
        self.results["runs"].append(dict(shape=shape, dtype=dtype, capacity=capacity, decode=[], verify=[], dflash=[], compile_s={}))
        return self.results["runs"][-1]

    def skip(self, where: dict, what: str, why: str = "time budget") -> None:
        where.setdefault("skipped", []).append(f"{what} ({why})")
        print(f"skipped: {what} ({why})", file=sys.stderr)


def measure_run(run: Run, plan: Plan, budget: Budget, report: Report, peak_bw: float) -> None:
    """Every measurement of one :class:`Run`, in priority order, into the entry of its model and dtype."""
    entry = report.entry(run.label, run.dtype, plan.capacity)
    if not budget.fits(2 if run.lengths else 1, 15.0):
        return report.skip(entry, f"decode {list(run.lengths)}, verify {list(run.widths)}, DFlash {list(run.accepts)}")
    if run.weights:
        cfg, dcfg = quantized_configs(run.shape, run.dtype, run.weights, plan.tiny)
        (params, dparams), init_s = clocked(lambda: quantized_models(cfg, dcfg, run.weights))
    else:
        cfg, dcfg = configs(run.shape, run.dtype, plan.tiny)
        (params, dparams), init_s = clocked(lambda: random_models(cfg, dcfg))
    if run.shape.endswith("-fp8"):  # the float weights converted on the device, then dropped
        params = as_fp8(params)
    entry.setdefault("init_s", init_s)  # a later run of the same model reuses the compiled initializer
    entry.update(weights_bytes=tree_bytes(params), drafter_bytes=tree_bytes(dparams), layers=cfg.num_hidden_layers,
                 block_size=dcfg.block_size)
    if run.lengths:
        plain = Generation(Params(params), Decoding(cfg), plan.capacity, plan.chunk)
        _compiled(entry, budget, "plain", plain.compile_s)
    for live in run.lengths:
        if budget.fits(0, 10.0):
            entry["decode"].append(decode_at(plain, cfg, live, plan.steps, plan.repeats, peak_bw))
            report.save()
        else:
            report.skip(entry, f"decode at live length {live}")
    for width in run.widths:
        if budget.fits(1):
            entry["verify"].append(verify_cost(params, cfg, plan.capacity, run.context, width, plan.calls, plan.repeats))
            _compiled(entry, budget, f"verify {width}", {"": entry["verify"][-1]["compile_s"]})
            report.save()
        else:
            report.skip(entry, f"verify of width {width}")
    plain_ms = next((d["step_ms"] for d in entry["decode"] if d["live"] == run.context), None)
    accepts = [a for a in run.accepts if a < dcfg.block_size]
    if accepts and (plain_ms is None or not budget.fits(2)):
        return report.skip(entry, f"DFlash {accepts}", "time budget" if plain_ms else "no plain decode at the same context")
    if accepts:
        spec = Generation(Params(params, dparams), Decoding(cfg, dcfg), plan.capacity, plan.chunk)
        _compiled(entry, budget, "dflash", spec.compile_s)
    for a in accepts:
        if budget.fits(0, 10.0):
            entry["dflash"].append(dflash_at(spec, run.context, a, plan.steps, plan.repeats, plain_ms))
            report.save()
        else:
            report.skip(entry, f"DFlash at acceptance {a}")
    for nodes in run.trees:
        if plain_ms is None or not budget.fits(2, 10.0):
            report.skip(entry, f"tree of {nodes} nodes", "time budget" if plain_ms else "no plain decode at the same context")
            continue
        gen = Generation(Params(params, dparams), Decoding(cfg, dcfg, tree=nodes), plan.capacity, plan.chunk)
        _compiled(entry, budget, f"tree {nodes}", gen.compile_s)
        entry["dflash"].append(dflash_at(gen, run.context, TREE_ACCEPT, plan.steps, plan.repeats, plain_ms))
        report.save()


def _compiled(entry: dict, budget: Budget, prefix: str, compile_s: dict) -> None:
    """Records compile seconds under ``prefix`` and lets the budget see them."""
    for name, s in compile_s.items():
        entry["compile_s"][f"{prefix} {name}".strip()] = s
    budget.saw(*compile_s.values())


def device_info() -> dict:
    """Backend, device kind and (on NVIDIA machines) what ``nvidia-smi`` says about the GPU."""
    dev = jax.devices()[0]
    info = dict(backend=jax.default_backend(), device_kind=dev.device_kind, devices=len(jax.devices()),
                matmul_precision=str(getattr(jax.config, "jax_default_matmul_precision", None)))
    try:
        q = "name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm"
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def check(plan: Plan, mode: str, out: Path, argv) -> dict:
    """Runs the plan: machine and device, copy bandwidth, oracle tests, then every run."""
    out.mkdir(parents=True, exist_ok=True)
    gpu = jax.default_backend() == "gpu"
    budget = Budget(plan.budget_s, 20.0 if gpu else 2.0)
    results = dict(tool="gpu_check", mode=mode, command="python tools/gpu_check.py " + " ".join(shlex.quote(a) for a in argv),
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), machine=machine(),
                   device=device_info(), budget_s=plan.budget_s, plan=dataclasses.asdict(plan), runs=[])
    report = Report(out, results, budget.t0)
    report.save()
    files, expr = plan.oracle
    results["oracle_tests"] = oracle_tests(files, expr, min(plan.oracle_s, budget.left() / 3), jax.default_backend(),
                                           out / "oracle_tests.log")
    print(f"oracle tests: {results['oracle_tests']['passed']} passed, {results['oracle_tests']['failed']} failed", file=sys.stderr)
    results["mesh"] = mesh_check()
    print(f"mesh: {results['mesh']}", file=sys.stderr)
    results["copy_bandwidth"] = copy_bandwidth(plan.copy_bytes, plan.repeats)
    peak = H200_COPY_BW if gpu else results["copy_bandwidth"]["bytes_per_s"]
    results["peak_bytes_per_s"] = peak
    results["peak_source"] = "4.3 TB/s, copy bandwidth of an H200 (KINDS.md)" if gpu else "copy bandwidth measured in this run"
    report.save()
    for run in plan.runs:
        print(f"run: {run.label} {run.dtype} ({budget.left():.0f} s left)", file=sys.stderr)
        try:
            measure_run(run, plan, budget, report, peak)
        except Exception as e:  # one failing run (out of memory, say) must not cost the others
            report.skip(report.entry(run.label, run.dtype, plan.capacity), "the rest of this run", f"{type(e).__name__}: {e}"[:600])
            traceback.print_exc()
            del e
        gc.collect()  # the run's weights go before the next run's come
    report.save()
    return results


def _prepare_process(dry_run: bool) -> None:
    """Settings read when JAX starts its backend (at the first device use, after this)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave device memory to the pytest subprocess (run first)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # Laguna-XS-2.1 in bf16: 67 GB of weights plus temporaries
    if dry_run:  # the dry run checks code, not speed: compile quickly
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    try:  # compile times are those of a first run: no persistent cache (dflash_jax's or JAX_COMPILATION_CACHE_DIR)
        jax.config.update("jax_enable_compilation_cache", False)
    except AttributeError:  # a JAX without the option
        pass


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="fewer lengths, widths and acceptance rates (about half the time)")
    g.add_argument("--dry-run", action="store_true", help="tiny shapes on whatever backend is there (CI runs this on the CPU)")
    g.add_argument("--merge", metavar="MD", help="put a gpu_check.md written by a run into --benchmarks, and do nothing else")
    g.add_argument("--plans", action="store_true", help="print the plans (full, quick, dry-run) as JSON, and do nothing else")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json, gpu_check.md, oracle_tests.log "
                   "(default: $OUT, else a new temporary folder)")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget in seconds (default: the mode's: 420 full, 240 quick)")
    p.add_argument("--benchmarks", default=str(Path(__file__).resolve().parents[1] / "BENCHMARKS.md"), help="the file --merge writes")
    args = p.parse_args(argv)
    if args.plans:
        print(json.dumps({name: dataclasses.asdict(plan) for name, plan in PLANS.items()}, indent=1))
        return 0
    if args.merge:
        write_section(Path(args.benchmarks), "device", Path(args.merge).read_text(encoding="utf-8"), tool="gpu_check")
        print(f"wrote {args.benchmarks}", file=sys.stderr)
        return 0
    mode = "dry-run" if args.dry_run else "quick" if args.quick else "full"
    _prepare_process(args.dry_run)
    plan = PLANS[mode]
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    results = check(plan, mode, out, argv)
    print((out / "gpu_check.md").read_text(encoding="utf-8"))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {results['elapsed_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
