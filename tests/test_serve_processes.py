"""``dflash-jax serve`` over 2 processes x 2 CPU devices on loopback (``--mesh data=2,model=2``,
JAX's multi-controller runtime): process 0 listens, process 1 follows its schedule
(dflash_jax/serve/follow.py). Oracle: the same requests answered by ``dj.generate`` on one device
in this process (float32, highest matmul precision), through the ``openai`` client: greedy DFlash
requests sent at once, and a seeded sampled one. A SIGTERM to process 0 stops both with 0; a
process started with another option stops both with an error naming it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import openai
import pytest
from conftest import xla_flags
from serve_util import free_port
from test_serve_cli import _wait_healthy

import dflash_jax as dj
from dflash_jax.decode.sampling import SamplingConfig

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 17, 3, 40, 2], [40, 2, 7], [1, 2, 3, 4]]


def _group(folder, drafter_folder, extra=((), ())):
    """Starts ``serve`` as processes 0 and 1 of a group; returns ``(processes, url)``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2),
               JAX_DEFAULT_MATMUL_PRECISION="highest")
    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    common = ["serve", "--target", str(folder), "--draft", str(drafter_folder), "--n-max", "3", "--max-batch", "4", "--max-len", "128",
              "--served-model-name", "t", "--mesh", "data=2,model=2", "--port", str(port), "--coordinator", coordinator,
              "--num-processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_jax", *common, "--process-id", str(i), *extra[i]], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    return procs, f"http://127.0.0.1:{port}"


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_two_processes_serve_as_one_device_and_stop_on_sigterm(serve_tiny_model, tmp_path):
    from dflash_jax.train.export import export_drafter

    folder, target, drafter = serve_tiny_model
    export_drafter(tmp_path / "d", drafter.cfg, drafter.params, dtype="float32")
    sampled = SamplingConfig(temperature=0.8, top_p=0.9)
    with jax.default_matmul_precision("highest"):
        want = dj.generate(target, PROMPTS, max_new_tokens=20, drafter=drafter, n_max=3, ignore_eos=True).texts
        want.append(dj.generate(target, [PROMPTS[0]], max_new_tokens=20, drafter=drafter, n_max=3, ignore_eos=True, sampling=sampled,
                                seed=7).texts[0])
    procs, url = _group(folder, tmp_path / "d")
    try:
        _wait_healthy(url, procs[0], timeout=240)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

        def ask(i):
            kw = dict(temperature=0.8, top_p=0.9, seed=7) if i == len(PROMPTS) else dict(temperature=0)
            return c.completions.create(model="t", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=20, extra_body={"ignore_eos": True}, **kw)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = [r.choices[0].text for r in pool.map(ask, range(len(PROMPTS) + 1))]
        assert got == want
        assert procs[1].poll() is None  # the follower serves nothing itself but is still there
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in procs]
        errs = [p.stderr.read() for p in procs]
        assert codes == [0, 0], errs
        assert "process 1 follows process 0's schedule" in errs[1]
    finally:
        _kill(procs)


@pytest.mark.slow
def test_a_process_started_with_another_option_stops_the_group(serve_tiny_model, tmp_path):
    from dflash_jax.train.export import export_drafter

    folder, _, drafter = serve_tiny_model
    export_drafter(tmp_path / "d", drafter.cfg, drafter.params, dtype="float32")
    procs, _ = _group(folder, tmp_path / "d", extra=((), ("--max-len", "256")))
    try:
        outs = [p.communicate(timeout=400) for p in procs]
        assert [p.returncode for p in procs] == [2, 2], outs
        assert "error: --max-len: 256 on process 1, 128 on process 0 (expected the same value on every process)" in outs[1][1], outs[1][1]
        assert "error: --process-id: another process was started with other options" in outs[0][1], outs[0][1]
    finally:
        _kill(procs)
