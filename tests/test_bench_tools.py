"""The pure parts of the benchmark tools, run as programs (tools/ is never put on this process's
``sys.path``): ``bench_spec``'s interval resamples the ratio it reports, and the argument types
name what is wrong. (The tests of bench_policy, bench_attention and bench_recall went with the
scripts, retired after commit 9868b87: BENCHMARKS.md keeps their figures.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def tool_function(script: str, name: str, *args):
    """``name(*args)`` of ``tools/<script>``, run in a child process (``runpy``: the script's
    module-level code runs, not its ``__main__`` part); arguments and result travel as JSON."""
    code = ("import json, runpy, sys; f = runpy.run_path(sys.argv[1])[sys.argv[2]]; "
            "print(json.dumps(f(*json.loads(sys.argv[3]))))")
    r = subprocess.run([sys.executable, "-c", code, f"tools/{script}", name, json.dumps(args)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def _runs(pairs):
    return dict(per_batch=[tuple(p) for p in pairs])


def test_interval_resamples_the_ratio_of_sums():
    # One long batch where a is slow, nine short ones where a is fast: the mean of per-batch
    # rates says a is faster, the ratio of sums (the reported figure) says it is slower.
    a = _runs([(100, 100.0)] + [(10, 0.5)] * 9)
    b = _runs([(100, 50.0)] + [(10, 1.0)] * 9)
    a_same = _runs([(32, 1.5), (30, 2.0), (28, 1.0)])
    (lo, hi), same = (tool_function("bench_spec.py", "ratio_interval", *x) for x in ((a, b, 0, 4000), (a_same, a_same)))
    point = (190 / 104.5) / (190 / 59.0)
    assert lo <= point <= hi
    # the same draws by hand: resample batch indices, then sums of tokens over sums of seconds
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 10, (4000, 10))
    pa, pb = np.array(a["per_batch"]), np.array(b["per_batch"])
    r = np.sort((pa[idx, 0].sum(1) / pa[idx, 1].sum(1)) / (pb[idx, 0].sum(1) / pb[idx, 1].sum(1)))
    assert (lo, hi) == pytest.approx((r[100], r[3900]))
    # the interval of identical runs is one
    assert same == pytest.approx([1.0, 1.0])


def test_argument_types_accept_and_name_what_is_wrong():
    code = ("import json, runpy, sys; g = runpy.run_path('tools/benchlib.py'); out = {'ok': [g['int_list']('1,8'), g['at_least'](0)('0')]}\n"
            "for name, make, texts in (('int_list', lambda: g['int_list'], ('1,,2', '0', '1,1', 'a', '')),\n"
            "                          ('at_least', lambda: g['at_least'](1), ('0', '-1', 'x'))):\n"
            "    for t in texts:\n"
            "        try:\n"
            "            make()(t)\n"
            "            out.setdefault(name, []).append(None)\n"
            "        except Exception as e:\n"
            "            out.setdefault(name, []).append([type(e).__name__, str(e)])\n"
            "print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["ok"] == [[1, 8], 0]
    assert len(got["int_list"]) == 5 and len(got["at_least"]) == 3
    for kind, msg in got["int_list"]:
        assert kind == "ArgumentTypeError" and "distinct integers >= 1" in msg
    for kind, msg in got["at_least"]:
        assert kind == "ArgumentTypeError" and "integer >= 1" in msg


@pytest.mark.parametrize("argv, says", [(["--batches", "1,1"], "expected comma-separated distinct integers >= 1, got '1,1'"),
                                        (["--max-new-tokens", "0"], "expected an integer >= 1, got '0'"),
                                        (["--humaneval", "0", "--chat", "0"], "both 0, so no prompt is left to run")])
def test_bench_spec_refuses_a_bad_command_line_before_loading(argv, says):
    r = subprocess.run([sys.executable, "tools/bench_spec.py", *argv, "--no-write"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and says in r.stderr, r.stderr[-3000:]


def test_no_import_circle_among_the_tools():
    """The scripts of tools/ import one another (``from benchlib import ...``) without a circle, and
    none imports a retired or moved script."""
    import ast

    from test_architecture import find_cycles

    names = {p.stem for p in (REPO / "tools").glob("*.py")}
    graph = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((REPO / "tools" / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        gone = found & {"prompts", "ttft", "spec_continuous", "gpu_shapes", "gpu_report", "make_train_data", "make_code_data",
                        "calibrate_depth"}
        assert not gone, f"tools/{name}.py imports {gone}"
        graph[name] = (found & names) - {name}
    assert graph["bench_spec"] == {"benchlib", "speclib"} and not find_cycles(graph)
