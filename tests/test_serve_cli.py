"""``dflash-jax serve`` as a command: graceful SIGTERM/SIGINT (exit 0, running requests finish),
exit 1 when the engine dies, one-line option errors, and the default pair end to end."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from serve_util import free_port, raw, run_in_thread, serve_in_thread

import dflash_jax as dj
from dflash_jax.cli import main as cli

REPO = Path(__file__).resolve().parents[1]


def _wait_healthy(url, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if raw(url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")


def test_sigterm_finishes_running_requests_and_exits_0_sigint_too(serve_tiny_model):
    folder = serve_tiny_model[0]
    for sig in (signal.SIGTERM, signal.SIGINT):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "dflash_jax", "serve", "--target", str(folder), "--no-spec", "--port", str(port),
                                 "--max-batch", "2", "--max-len", "128", "--served-model-name", "t"],
                                cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc)
            if sig == signal.SIGTERM:  # a request in flight when the signal comes finishes
                c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
                stream = c.completions.create(model="t", prompt=[1, 2, 3], max_tokens=40, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
                it = iter(stream)
                first = next(it)
                proc.send_signal(sig)
                rest = list(it)
                assert first.choices and rest[-1].choices[0].finish_reason == "length"
            else:
                proc.send_signal(sig)
            assert proc.wait(120) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()


def test_engine_death_ends_the_command_with_1(serve_tiny_model, monkeypatch, capsys):
    from dflash_jax.serve.engine import Engine

    real_round = Engine._round

    def broken_round(self):  # only the command's engine: the suite's shared "tiny" server keeps running
        if self.model.name == "tiny":
            return real_round(self)
        raise RuntimeError("device lost")

    monkeypatch.setattr(Engine, "_round", broken_round)
    code = cli.main(["serve", "--target", str(serve_tiny_model[0]), "--no-spec", "--port", str(free_port()), "--max-len", "64"])
    assert code == 1
    assert "error: the engine died: RuntimeError: device lost" in capsys.readouterr().err


@pytest.mark.parametrize("args,line", [
    (["--max-batch", "0"], "error: --max-batch: got 0 (expected an integer >= 1)"),
    (["--port", "70000"], "error: --port: got 70000 (expected an integer in [1, 65535])"),
    (["--no-spec", "--n-max", "2"], "error: --n-max: conflicts with --no-spec"),
    (["--max-len", "100000"], "error: --max-len: 100000 exceeds the target's 512 positions"),
    (["--max-batch", "x"], "error: --max-batch: got 'x' (expected an integer)"),
    (["--tree", "3"], "error: --tree: given without a drafter"),
])
def test_bad_options_are_one_line_errors(serve_tiny_model, capsys, args, line):
    code = cli.main(["serve", "--target", str(serve_tiny_model[0]), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err


def test_tree_options_name_the_tree_or_the_option(serve_tiny_model, capsys, tmp_path):
    """``serve --tree``: the start-up line names the default decoding it builds (the tree's nodes
    and depth), and a tree the target cannot verify is a one-line error naming ``--tree``."""
    from dflash_jax.cli import serve as serve_cli
    from dflash_jax.train.export import export_drafter

    folder, _, drafter = serve_tiny_model
    export_drafter(tmp_path / "d", drafter.cfg, drafter.params, dtype="float32")
    common = ["serve", "--target", str(folder), "--draft", str(tmp_path / "d"), "--max-len", "256"]
    _, why = serve_cli.build_engine(cli.build_parser().parse_args([*common, "--n-max", "3", "--tree", "5"]))
    assert why.endswith("; n_max 3 over a tree of 5 nodes"), why
    _, why = serve_cli.build_engine(cli.build_parser().parse_args([*common, "--n-max", "3"]))
    assert why.endswith("; n_max 3"), why
    code = cli.main([*common, "--tree", "16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --tree: got 16 (expected an integer in [1, 15]") and err.count("\n") == 1, err


@pytest.mark.slow
def test_default_pair_end_to_end():
    """The embedded SmolLM2-135M with its shipped drafter: DFlash answers, streamed and whole, equal
    generate's, with acceptance reported."""
    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    engine = Engine(ServedModel(target, drafter, name="smollm2"), max_batch=1, max_len=256)  # one size to warm up
    url, stop = serve_in_thread(build_app(engine))
    try:
        messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        ids = dj.encode_prompt(target, messages[0]["content"])
        want = dj.generate(target, [ids], max_new_tokens=24, drafter=drafter, max_len=256)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want.texts[0] and r.usage.completion_tokens == len(want.output_ids[0])
        assert r.speculative["tau"] > 1 and r.usage.completion_tokens_details.accepted_prediction_tokens > 0
        chunks = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.texts[0]
        assert json.loads(raw(url + "/health")[2])["status"] == "ready"
    finally:
        stop()


def _draining(engine, grace):
    """``(url, server, thread)``: a :class:`DrainingServer` of ``engine`` on a free port, in a thread."""
    import uvicorn

    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.shutdown import DrainingServer

    server = DrainingServer(uvicorn.Config(build_app(engine, shutdown_timeout=grace), log_level="warning",
                                           timeout_graceful_shutdown=grace), engine, grace)
    url, thread = run_in_thread(server)
    return url, server, thread


@pytest.mark.parametrize("grace", [30.0, 0.3])
def test_a_stop_drains_streams_and_answers_new_requests_503(serve_tiny_model, grace, capfd):
    """The first exit signal drains: a stream in flight gets every token (or, past the grace
    period, a final error event: never a silent cut); a request sent meanwhile gets 503 with
    Retry-After while the server still listens; then the server stops, without tracebacks."""
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    engine = Engine(ServedModel(serve_tiny_model[1], None, name="t"), max_batch=1, max_len=128, steps_per_round=2)
    real_decode = engine._decode

    def slow_decode():  # two tokens per 0.1 s: a 60-token answer outlasts the short grace
        time.sleep(0.1)
        real_decode()

    engine._decode = slow_decode
    url, server, thread = _draining(engine, grace)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    ask = dict(model="t", prompt=[1, 2, 3], max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**ask).choices[0].text
    stream = iter(c.completions.create(**ask, stream=True))
    first = next(stream)
    server.handle_exit(signal.SIGTERM, None)
    while engine.counts() == (1, 0) and not engine._stopping:
        time.sleep(0.01)
    status, headers, body = raw(url + "/v1/completions", "POST", json.dumps({"model": "t", "prompt": [1], "max_tokens": 2}).encode())
    assert status == 503 and headers["retry-after"] and json.loads(body)["error"]["code"] == "unavailable", body
    if grace > 1:
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        assert first.choices[0].text + "".join(ch.choices[0].text for ch in rest if ch.choices) == whole
    else:
        with pytest.raises(openai.APIError, match="shutting down"):
            list(stream)
    thread.join(30)
    assert not thread.is_alive() and not server.drain.is_alive()
    assert "Traceback" not in capfd.readouterr().err


def test_a_second_signal_during_the_drain_hands_over_to_uvicorn():
    """While the drain waits on running requests, a second signal starts uvicorn's own shutdown at
    once, and a further SIGINT forces the exit (README, ``--shutdown-timeout``)."""
    import uvicorn

    from dflash_jax.serve.shutdown import DrainingServer

    release = threading.Event()

    class Engine:  # one request running; its drain lasts until released
        stopped = False

        def counts(self):
            return 1, 0

        def stop(self, grace):
            release.wait(30)
            self.stopped = True

    server = DrainingServer(uvicorn.Config(lambda *a: None), Engine(), 30.0)
    server.handle_exit(signal.SIGTERM, None)
    assert server.drain.is_alive() and not server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit and server.drain.is_alive()
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit
    release.set()
    server.drain.join(30)
    assert server.engine.stopped
