"""The ``dflash-jax generate`` command line, run in-process on a tiny HF checkpoint (and once on the default model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_hf  # noqa: E402

from dflash_jax.cli import generate as generate_cli  # noqa: E402
from dflash_jax.cli import main as cli  # noqa: E402
from dflash_jax.families.dense.safetensors import load_hf_target  # noqa: E402
from dflash_jax.testing import reference_greedy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "smollm2_llamacpp_greedy.json"
PROMPT_IDS = [256, 117, 115, 101, 114, 10, 72, 105, 257, 10, 256]
STATS_KEYS = {"new_tokens", "compile_time_s", "prefill_time_s", "decode_time_s", "decode_tokens_per_s"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf.make_tiny_hf(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="module")
def bare_dir(hf_dir, tmp_path_factory):
    return tiny_hf.without_tokenizer(hf_dir, tmp_path_factory.mktemp("tiny_hf_bare"))


@pytest.fixture(scope="module")
def model(hf_dir):
    cfg, params = load_hf_target(hf_dir)
    return cfg, params


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, "generate", "--json", *argv)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, "stdout must hold exactly one JSON object"
    return json.loads(lines[0]), err


def assert_one_line_error(code, out, err, *needles):
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0]
    return lines[0]


def test_json_schema_and_values_with_prompt_ids(capsys, hf_dir, model):
    cfg, params = model
    ids = ",".join(map(str, PROMPT_IDS))
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", ids, "--max-new-tokens", 9, "--ignore-eos", "--chunk-size", 4)
    assert set(obj) == {"prompt_ids", "output_ids", "text", "finish_reason", "top2_logit_gaps", "stats"}
    assert obj["prompt_ids"] == PROMPT_IDS
    assert obj["output_ids"] == reference_greedy(params, cfg, PROMPT_IDS, 9)
    assert obj["finish_reason"] == "length"
    assert len(obj["top2_logit_gaps"]) == 9 and all(g >= 0 for g in obj["top2_logit_gaps"])
    assert isinstance(obj["text"], str)
    st = obj["stats"]
    assert STATS_KEYS <= set(st)
    assert st["new_tokens"] == 9 and st["mode"] == "plain"
    assert st["compile_time_s"] > 0 and st["prefill_time_s"] > 0 and st["decode_time_s"] > 0
    assert st["decode_tokens_per_s"] == pytest.approx(8 / st["decode_time_s"], rel=1e-2)


def test_text_prompt_streams_what_json_reports(capsys, hf_dir):
    obj, _ = run_json(capsys, "--target", hf_dir, "Hello there", "--max-new-tokens", 24, "--ignore-eos")
    code, out, err = run(capsys, "generate", "--target", hf_dir, "Hello there", "--max-new-tokens", 24, "--ignore-eos")
    assert code == 0
    assert out == obj["text"] + "\n"
    assert obj["prompt_ids"][:2] == [tiny_hf.IM_START, ord("u")]  # chat template applied
    last = err.strip().splitlines()[-1]
    assert "plain decoding" in last and "tok/s" in last and "prefill" in last


def test_raw_and_system(capsys, hf_dir):
    obj, _ = run_json(capsys, "--target", hf_dir, "--raw", "Hi", "--max-new-tokens", 1)
    assert obj["prompt_ids"] == [ord("H"), ord("i")]
    obj, _ = run_json(capsys, "--target", hf_dir, "--system", "S", "Hi", "--max-new-tokens", 1)
    assert obj["prompt_ids"][:10] == [tiny_hf.IM_START, *b"system\nS", tiny_hf.IM_END]


def test_sampling_is_seeded(capsys, hf_dir):
    args = ("--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 12, "--ignore-eos", "--temperature", 1.0,
            "--top-k", 40, "--top-p", 0.9)
    a, _ = run_json(capsys, *args, "--seed", 1)
    b, _ = run_json(capsys, *args, "--seed", 1)
    c, _ = run_json(capsys, *args, "--seed", 2)
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


def test_stop_texts(capsys, hf_dir):
    base, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40, "--ignore-eos")
    text = base["text"]
    # a printable two-character stop text (two byte tokens: checked on the decoded text)
    i = next(i for i in range(3, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
    stop = text[i : i + 2]
    first = text.index(stop)
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40, "--ignore-eos", "--stop", stop)
    assert obj["finish_reason"] == "stop"
    assert obj["text"] == text[:first]
    n = len(obj["output_ids"])
    assert obj["output_ids"] == base["output_ids"][:n] and len(obj["top2_logit_gaps"]) == n
    # streamed output is cut at the same place
    code, out, _ = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40, "--ignore-eos",
                       "--stop", stop)
    assert code == 0 and out == text[:first] + "\n"
    # a one-token stop text becomes a stop id: the row ends on device, the token kept in output_ids
    tok = stop[0]
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40, "--ignore-eos", "--stop", tok)
    k = base["output_ids"].index(ord(tok))
    assert obj["output_ids"] == base["output_ids"][: k + 1] and obj["finish_reason"] == "stop"
    assert obj["stats"]["steps"] == k
    # ... and its text ends just before the stop text, like a longer one (and like the stream)
    assert obj["text"] == text[: text.index(tok)]
    code, out, _ = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40, "--ignore-eos",
                       "--stop", tok)
    assert code == 0 and out == obj["text"] + "\n"


def test_eos_and_capacity(capsys, hf_dir, model):
    cfg, params = model
    free = reference_greedy(params, cfg, [1, 2, 3], 40)
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40)
    if tiny_hf.IM_END in free:
        assert obj["output_ids"] == free[: free.index(tiny_hf.IM_END) + 1] and obj["finish_reason"] == "stop"
    else:
        assert obj["output_ids"] == free and obj["finish_reason"] == "length"
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 40, "--max-len", 8,
                      "--ignore-eos")
    assert obj["output_ids"] == free[:5] and obj["finish_reason"] == "capacity"


def test_a_budget_cut_is_named_and_the_default_budget_fits_the_context(capsys, hf_dir, model):
    """An answer that the budget cut ends with a note naming --max-new-tokens (not when
    --ignore-eos asked for the whole budget); the default budget (512) shrinks to the room left
    after the prompt in --max-len, else in the target's max_position_embeddings."""
    from types import SimpleNamespace

    cfg, params = model
    free = reference_greedy(params, cfg, [1, 2, 3], 3)
    common = ("generate", "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 3)
    note = "note: the answer was cut by the new-token budget (3 tokens); --max-new-tokens 6 lets it run longer"
    code, out, err = run(capsys, *common)
    assert code == 0 and (note in err) == (tiny_hf.IM_END not in free)
    code, out, err = run(capsys, *common, "--ignore-eos")
    assert code == 0 and "note:" not in err
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--ignore-eos", "--max-len", 16)
    assert obj["stats"]["new_tokens"] == 13
    args = SimpleNamespace(max_new_tokens=None, max_len=None)
    assert generate_cli._budget(args, SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=512)), [1, 2, 3]) == 509
    assert generate_cli._budget(args, SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=8192)), [1, 2, 3]) == generate_cli.DEFAULT_MAX_NEW_TOKENS


def test_prompt_ids_without_tokenizer(capsys, bare_dir, model):
    cfg, params = model
    obj, _ = run_json(capsys, "--target", bare_dir, "--prompt-ids", "5,6,7", "--max-new-tokens", 4, "--ignore-eos")
    assert obj["text"] is None and obj["output_ids"] == reference_greedy(params, cfg, [5, 6, 7], 4)
    code, out, err = run(capsys, "generate", "--target", bare_dir, "--prompt-ids", "5,6,7", "--max-new-tokens", 3, "--ignore-eos")
    assert code == 0 and out.split() == [str(i) for i in obj["output_ids"][:3]]
    code, out, err = run(capsys, "generate", "--target", bare_dir, "Hello")
    assert_one_line_error(code, out, err, "tokenizer", "--prompt-ids")


def test_missing_target_is_one_line_error(capsys, tmp_path):
    missing = tmp_path / "nope"
    code, out, err = run(capsys, "generate", "--target", missing)
    assert_one_line_error(code, out, err, str(missing))
    (tmp_path / "file.bin").write_bytes(b"x")
    code, out, err = run(capsys, "generate", "--target", tmp_path / "file.bin")
    assert_one_line_error(code, out, err, "file.bin", "expected")
    code, out, err = run(capsys, "generate", "--target", tmp_path)  # a folder without config.json
    assert_one_line_error(code, out, err, "config.json")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--top-p", "1.5"], "--top-p"),
        (["--top-p", "0"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--chunk-size", "0"], "--chunk-size"),
        (["--max-len", "4"], "--max-len"),  # the prompt is longer than the capacity
        (["--prompt-ids", "1,2,999999"], "999999"),
        (["--draft", "missing_drafter"], "missing_drafter"),
    ],
)
def test_bad_options_are_one_line_errors(capsys, hf_dir, args, needle):
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2,3,4,5", *args)
    line = assert_one_line_error(code, out, err, needle)
    assert "Traceback" not in err
    if needle == "--max-len":
        assert "expected" in line


@pytest.fixture(scope="module")
def draft_dir(hf_dir, tmp_path_factory):
    """A tiny random DFlash drafter for the tiny target, in the z-lab layout."""
    from dflash_jax import loading
    from dflash_jax.testing import tiny_drafter
    from dflash_jax.train.export import export_drafter

    cfg, params = tiny_drafter(loading.load_target(hf_dir).cfg, seed=3, layer_ids=(0, 1), block_size=4)
    folder = tmp_path_factory.mktemp("draft")
    export_drafter(folder, cfg, params, dtype="float32")
    return folder


def test_speculative_json_equals_plain_and_reports_acceptance(capsys, hf_dir, draft_dir):
    common = ("--target", hf_dir, "--prompt-ids", "5,6,7,8", "--max-new-tokens", 12, "--ignore-eos")
    spec_obj, _ = run_json(capsys, *common, "--draft", draft_dir)
    plain_obj, _ = run_json(capsys, *common, "--no-spec")
    assert spec_obj["output_ids"] == plain_obj["output_ids"] and len(spec_obj["output_ids"]) == 12
    st = spec_obj["stats"]
    assert st["mode"] == "dflash" and plain_obj["stats"]["mode"] == "plain"
    assert len(st["accepted_per_position"]) == 3 and st["verify_steps"] >= 1
    assert st["tau"] == pytest.approx(11 / st["verify_steps"], abs=1e-3)  # the first token comes from prefill
    assert st["drafted_tokens"] >= st["accepted_tokens"] >= 0
    short, _ = run_json(capsys, *common, "--draft", draft_dir, "--n-max", 2)
    assert len(short["stats"]["accepted_per_position"]) == 2 and short["output_ids"] == plain_obj["output_ids"]
    code, out, err = run(capsys, "generate", *common, "--draft", draft_dir, "--tree", 16)
    assert_one_line_error(code, out, err, "--tree: got 16", "[1, 15]", "0 for generate and --tree")
    tree, _ = run_json(capsys, *common, "--draft", draft_dir, "--n-max", 2, "--tree", 5)  # a tree of 5 nodes, 2 deep
    assert tree["output_ids"] == plain_obj["output_ids"] and tree["stats"]["tree"] == 5 and short["stats"]["tree"] is None
    assert tree["stats"]["widths"][5] == tree["stats"]["verify_steps"] and len(tree["stats"]["accepted_per_position"]) == 2


def test_adaptive_depth_json_reports_widths_and_measured_costs(capsys, hf_dir, draft_dir, tmp_path, monkeypatch):
    """`--n-max auto --measure-costs --json`: the output of plain greedy decoding, the histogram of
    chosen widths and the plain steps, and costs measured now (kept under the cache folder)."""
    from dflash_jax.decode.auto import costs

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "STABLE", 100.0)  # the tiny pair's steps take a millisecond: timer noise
    common = ("--target", hf_dir, "--prompt-ids", "5,6,7,8", "--max-new-tokens", 12, "--ignore-eos")
    plain_obj, _ = run_json(capsys, *common, "--no-spec")
    obj, _ = run_json(capsys, *common, "--draft", draft_dir, "--n-max", "auto", "--measure-costs")
    st = obj["stats"]
    assert obj["output_ids"] == plain_obj["output_ids"]
    assert st["n_max"] == "auto" and st["cost_model"] == "measured" and len(list((tmp_path / "depth_costs").iterdir())) == 1
    assert len(st["widths"]) == 4 and sum(st["widths"]) + st["plain_steps"] == st["steps"] >= 1
    line = generate_cli._stats_line(st, "length")
    assert "widths " in line and f"plain {st['plain_steps']}" in line


def test_speculative_streaming_says_which_mode(capsys, hf_dir, draft_dir):
    code, out, err = run(capsys, "generate", "--target", hf_dir, "hi", "--draft", draft_dir, "--max-new-tokens", 6)
    assert code == 0 and "dflash decoding" in err and "tau" in err and str(draft_dir) in err
    code, out, err = run(capsys, "generate", "--target", hf_dir, "hi", "--max-new-tokens", 3)
    assert code == 0 and "plain decoding" in err and "no drafter ships" in err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--n-max", "4"], "--n-max: got 4"),
        (["--block-size", "6"], "--block-size: got 6 (expected an integer in [2, 4] (the drafter's block_size))"),
        (["--block-size", "20"], "--block-size: got 20 (expected an integer in [2, 4]"),
        (["--block-size", "1"], "--block-size: got 1"),
        (["--n-max", "2", "--block-size", "4"], "--n-max"),
        (["--no-spec", "--n-max", "3"], "--n-max: conflicts with --no-spec"),
        (["--no-spec", "--block-size", "3"], "--block-size: conflicts with --no-spec"),
        (["--n-max", "deep"], "--n-max: got 'deep' (expected an integer or auto)"),
        (["--n-max", "auto", "--block-size", "3"], "--block-size: given with --n-max auto"),
        (["--n-max", "2", "--measure-costs"], "--measure-costs: given with n_max 2"),
    ],
)
def test_bad_speculative_options(capsys, hf_dir, draft_dir, args, needle):
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2", "--draft", draft_dir, *args)
    line = assert_one_line_error(code, out, err, needle)
    assert "(expected " in line


def test_bad_draft_paths_and_depth_without_drafter(capsys, hf_dir, tmp_path):
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2", "--draft", tmp_path / "nope")
    assert_one_line_error(code, out, err, "nope")
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2", "--n-max", 3)
    assert_one_line_error(code, out, err, "--n-max", "without a drafter")
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2", "--draft", hf_dir, "--no-spec")
    assert_one_line_error(code, out, err, "--draft: conflicts with --no-spec")
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2", "--measure-costs", "--no-spec")
    assert_one_line_error(code, out, err, "--measure-costs: conflicts with --no-spec")


def test_debug_shows_traceback(capsys, tmp_path):
    code, out, err = run(capsys, "generate", "--target", tmp_path / "nope", "--debug")
    assert code == 2 and out == ""
    assert "Traceback (most recent call last)" in err and "DFlashError" in err
    assert err.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["generate", "--max-new-tokens", "abc"], "error: --max-new-tokens: got 'abc' (expected an integer)"),
        (["generate", "--temperature", "warm"], "error: --temperature: got 'warm' (expected a number)"),
        (["generate", "--chat-template-kwargs", "{bad"], "error: --chat-template-kwargs: not valid JSON"),
        (["generate", "--chat-template-kwargs", "[1]"], "error: --chat-template-kwargs: got list (expected a JSON object)"),
        (["generate", "--prompt-ids", "1,x"], "error: --prompt-ids: got '1,x' (expected a comma-separated list of integers"),
        (["generate", "--dtype", "int8"], "error: --dtype: got 'int8' (expected one of: float32, bfloat16, float16)"),
        (["generate", "--weights", "fp4"], "error: --weights: got 'fp4' (expected one of: auto, quantized, float, int8)"),
        (["train", "--data", "d", "--out", "o", "--weights", "q"], "error: --weights: got 'q' (expected one of: auto, quantized, float, int8)"),
        (["generate", "--no-such-option"], "error: --no-such-option: unknown option (expected an option listed by dflash-jax generate --help)"),
        (["--no-such-option"], "error: --no-such-option: unknown option (expected an option listed by dflash-jax --help)"),
        (["generate", "one", "two"], "error: two: unexpected extra argument (expected at most one PROMPT"),
        (["frobnicate"], "error: frobnicate: unknown command (expected one of: generate, serve, train, make-data, calibrate-depth)"),
        ([], "error: COMMAND: missing (expected one of: generate, serve, train, make-data, calibrate-depth"),
        (["generate", "--seed"], "error: --seed: missing value (expected a value after --seed)"),
        (["generate", "--json=1"], "error: --json: ignored explicit argument '1' (expected no value)"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, line):
    code, out, err = run(capsys, *argv)
    got = assert_one_line_error(code, out, err)
    assert got.startswith(line) and got.endswith(")"), got
    assert "usage:" not in err and "Traceback" not in err


@pytest.mark.smoke
def test_help_still_prints_and_exits_0(capsys):
    code, out, err = run(capsys, "generate", "--help")
    assert code == 0 and out.startswith("usage: dflash-jax generate") and "--max-new-tokens" in out
    code, out, err = run(capsys, "--help")
    assert code == 0 and "generate" in out


@pytest.mark.parametrize(
    "args, start",
    [
        (["--seed", "99999999999999999999"], "error: --seed: got 99999999999999999999 (expected an integer in [0, 2**63))"),
        (["--seed", "-1"], "error: --seed: got -1"),
        (["--max-new-tokens", "100000000"], "error: --max-new-tokens: 100000000 after a prompt of 3 tokens"),
        (["--max-len", "100000000"], "error: --max-len: 100000000 exceeds the target's 512 positions"),
        (["--temperature", "nan"], "error: --temperature: got nan (expected a finite number)"),
        (["--temperature", "inf"], "error: --temperature: got inf (expected a finite number)"),
        (["--top-p", "nan"], "error: --top-p: got nan (expected a finite number)"),
        (["--prompt-ids", "1,99999"], "error: --prompt-ids: token id 99999 outside the vocabulary (expected ids in [0, 260))"),
        (["--system", "S"], "error: --system: not used with --prompt-ids"),
        (["--raw"], "error: --raw: not used with --prompt-ids"),
        (["--chat-template-kwargs", '{"a": 1}'], "error: --chat-template-kwargs: not used with --prompt-ids"),
    ],
)
def test_out_of_range_and_ignored_options_are_one_line_errors(capsys, hf_dir, args, start):
    argv = ["generate", "--target", hf_dir, *args]
    if "--prompt-ids" not in args:
        argv += ["--prompt-ids", "1,2,3"]
    code, out, err = run(capsys, *argv)
    line = assert_one_line_error(code, out, err)
    assert line.startswith(start) and "(expected " in line, line


@pytest.mark.parametrize("args", [["--raw", ""], [""], [" \n"]])  # e.g. an unset shell variable; the chat template alone is no prompt
def test_empty_prompt_names_prompt(capsys, hf_dir, args):
    code, out, err = run(capsys, "generate", "--target", hf_dir, *args)
    line = assert_one_line_error(code, out, err)
    assert line.startswith("error: PROMPT: empty text") and "(expected a non-empty prompt" in line


def test_max_len_limit_is_the_targets(capsys, hf_dir):
    obj, _ = run_json(capsys, "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 2, "--max-len", 512)
    assert obj["stats"]["max_len"] == 512
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-len", 513)
    assert_one_line_error(code, out, err, "--max-len", "(expected an integer in [2, 512])")
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", 510)
    assert_one_line_error(code, out, err, "--max-new-tokens", "(expected at most 509)")


def _with_template(hf_dir, folder, template):
    import shutil

    shutil.copytree(hf_dir, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return folder


def test_chat_template_errors_follow_the_contract(capsys, hf_dir, tmp_path):
    refuses = _with_template(hf_dir, tmp_path / "refuses", "{% if messages[0]['role'] == 'system' %}"
                             "{{ raise_exception('System role not supported') }}{% endif %}{{ messages[0]['content'] }}")
    code, out, err = run(capsys, "generate", "--target", refuses, "--system", "S", "Hi")
    line = assert_one_line_error(code, out, err)
    assert line.startswith(f"error: {refuses}: chat template: ") and "System role not supported" in line
    assert "(expected " in line
    evil = _with_template(hf_dir, tmp_path / "evil", "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    code, out, err = run(capsys, "generate", "--target", evil, "Hi")
    line = assert_one_line_error(code, out, err)
    assert line.startswith(f"error: {evil}: chat template: ") and "sandbox" in line and "(expected " in line


def test_draft_that_is_an_existing_plain_file(capsys, hf_dir, tmp_path):
    f = tmp_path / "notafolder.txt"
    f.write_text("x")
    code, out, err = run(capsys, "generate", "--target", hf_dir, "--prompt-ids", "1,2", "--draft", f)
    assert_one_line_error(code, out, err, str(f), "exists but is neither a folder nor a .gguf file", "(expected ")


def test_prompt_and_prompt_ids_conflict(capsys, hf_dir):
    code, out, err = run(capsys, "generate", "--target", hf_dir, "Hello", "--prompt-ids", "1,2")
    assert_one_line_error(code, out, err, "--prompt-ids")


def test_python_dash_m_entry_point(tmp_path, hf_dir, model):
    """The program ends itself after generate (no teardown): all of its output still arrives, and
    its exit codes are main's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "dflash_jax", "generate", "--target", str(tmp_path / "nope")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such file or folder "
                                                "(expected a Hugging Face checkpoint folder or a .gguf file)"]
    cfg, params = model
    ids = ",".join(map(str, PROMPT_IDS))
    proc = subprocess.run([sys.executable, "-m", "dflash_jax", "generate", "--target", str(hf_dir), "--prompt-ids", ids,
                           "--max-new-tokens", "5", "--ignore-eos", "--json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and json.loads(proc.stdout)["output_ids"] == reference_greedy(params, cfg, PROMPT_IDS, 5)


@pytest.mark.slow
def test_default_model_matches_llamacpp_greedy(capsys):
    """The embedded default model, end to end through the CLI, against llama.cpp's greedy ids."""
    case = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"][0]
    n = 0  # compare only while llama.cpp's choice is confident (ours may differ below a 0.25 gap)
    while n < 8 and case["top2_logit_gap"][n] >= 0.25:
        n += 1
    assert n > 0
    obj, _ = run_json(capsys, case["user_message"], "--max-new-tokens", 8, "--ignore-eos")
    assert obj["prompt_ids"] == case["prompt_ids"]
    assert obj["output_ids"][:n] == case["greedy_ids"][:n]
    assert obj["stats"]["new_tokens"] == 8


def test_train_subcommand_dispatch_and_errors(capsys, tmp_path):
    """`dflash-jax train` reaches the trainer's CLI, with the same one-line error contract."""
    code, out, err = run(capsys, "train", "--out", tmp_path / "o", "--mask-token-id", 16)
    assert_one_line_error(code, out, err, "--data")
    assert err.strip() == "error: --data: missing (expected a value)"
    code, out, err = run(capsys, "train")
    assert err.strip() == "error: --data, --out, --mask-token-id: missing (expected a value)" and code == 2
    code, out, err = run(capsys, "train", "--bogus")
    assert_one_line_error(code, out, err, "--bogus: unknown option")
    code, out, err = run(capsys, "train", "--help")
    assert code == 0 and "--data DATA --out OUT" in " ".join(out.split())
    code, out, err = run(capsys, "train", "--data", tmp_path / "nope", "--out", tmp_path / "o", "--mask-token-id", 16)
    assert_one_line_error(code, out, err, "nope")


def test_drafter_recorded_n_max_is_the_default_depth(capsys, hf_dir, draft_dir, tmp_path):
    """`dflash_jax.n_max` in a drafter's config.json sets the depth when none is given."""
    import json
    import shutil

    folder = tmp_path / "d2"
    shutil.copytree(draft_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_jax"] = {"n_max": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    common = ("--target", hf_dir, "--prompt-ids", "5,6,7", "--max-new-tokens", 6, "--draft", folder)
    obj, _ = run_json(capsys, *common)
    assert obj["stats"]["n_max"] == 2
    obj, _ = run_json(capsys, *common, "--n-max", 3)
    assert obj["stats"]["n_max"] == 3
    for bad in ("two", 0, 20):  # not an integer; outside [1, block_size - 1] (no --n-max given)
        cfg["dflash_jax"] = {"n_max": bad}
        (folder / "config.json").write_text(json.dumps(cfg))
        code, out, err = run(capsys, "generate", *common)
        line = assert_one_line_error(code, out, err, "config.json: field dflash_jax.n_max", repr(bad))
        assert "--n-max" not in line


def test_every_option_says_what_it_does():
    """`--help` of both commands: every option has a help text (no bare option names)."""
    import argparse

    from dflash_jax.cli.train import build_parser as train_parser

    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for parser in [*sub.choices.values(), train_parser()]:
        bare = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
        assert not bare, f"{parser.prog}: options without help: {bare}"


def test_version_prints_the_package_version(capsys):
    """`dflash-jax --version` prints dflash_jax.__version__ and exits with 0, in-process and as the program."""
    import dflash_jax

    code, out, err = run(capsys, "--version")
    assert code == 0 and out.strip() == dflash_jax.__version__ and err == ""
    r = subprocess.run([sys.executable, "-m", "dflash_jax", "--version"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == dflash_jax.__version__, r.stderr


def test_every_subcommand_is_listed_and_has_help(capsys):
    """The dispatcher lists generate, serve, train, make-data and calibrate-depth; each one's --help exits with 0."""
    top = cli.build_parser()
    import argparse

    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["generate", "serve", "train", "make-data", "calibrate-depth"]
    for name in sub.choices:
        code, out, _ = run(capsys, name, "--help")
        assert code == 0 and f"dflash-jax {name}" in out


def test_calibrate_depth_refuses_bad_values_and_fits_a_known_calibration(capsys):
    """``dflash-jax calibrate-depth``: a bad value is one line naming the option (2, before anything
    loads); the per-position fit (:mod:`dflash_jax.decode.auto.calibrate`) recovers the scale and bias
    that made the acceptances, and conditions position i on drafts 1..i-1 accepted."""
    import numpy as np

    pytest.importorskip("scipy")
    from dflash_jax.decode.auto import calibrate

    for argv, says in ((["--max-new-tokens", "0"], "error: --max-new-tokens: got 0 (expected an integer >= 1)"),
                       (["--eval", "-1"], "error: --eval: got -1 (expected an integer >= 0)")):
        code, out, err = run(capsys, "calibrate-depth", *argv)
        assert code == 2 and out == "" and err.strip() == says
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.05, 0.95, (4000, 2))
    scale, bias = 1.5, -0.5
    accepted_1 = rng.uniform(size=4000) < 1 / (1 + np.exp(-(scale * calibrate.logit(conf[:, 0]) + bias)))
    accepted_2 = accepted_1 & (rng.uniform(size=4000) < 1 / (1 + np.exp(-(scale * calibrate.logit(conf[:, 1]) + bias))))
    acc, n_valid = accepted_1.astype(int) + accepted_2.astype(int), np.full(4000, 2)
    x2, y2 = calibrate.conditional_samples(conf, acc, n_valid, 2)
    assert len(x2) == int(accepted_1.sum()) and y2.sum() == accepted_2.sum()  # only steps that reached draft 2
    fitted = calibrate.fit_position(*calibrate.conditional_samples(conf, acc, n_valid, 1))
    assert fitted == pytest.approx((scale, bias), abs=0.15)
    rep = calibrate.report(conf, acc, n_valid, [fitted[0]] * 2, [fitted[1]] * 2)
    assert rep["observed"] == pytest.approx([accepted_1.mean(), accepted_2.mean()], abs=1e-4)
    assert rep["ece_fitted"][0] < rep["ece_raw"][0]


def test_calibrate_depth_names_the_options_when_nothing_was_recorded():
    """A budget that leaves no verify step to record (each prompt's only step is its last, never
    recorded) is a DFlashError naming --max-new-tokens and what would fill it, not an empty concatenate."""
    from dflash_jax.decode.auto.calibrate import record_steps
    from dflash_jax.errors import DFlashError, option_error
    from dflash_jax.loading import Drafter, Target
    from dflash_jax.testing import tiny_drafter, tiny_target

    tcfg, tparams = tiny_target()
    dcfg, dparams = tiny_drafter(tcfg)
    target, drafter = Target(cfg=tcfg, params=tparams), Drafter(cfg=dcfg, params=dparams)
    with pytest.raises(DFlashError) as e:
        record_steps(target, drafter, [[1, 2, 3], [4, 5]], 1, 32)
    msg = str(option_error(e.value))
    assert msg.startswith("--max-new-tokens: 1 new tokens per prompt recorded no verify step over 2 prompts"), msg
    assert "(expected more new tokens per prompt (at least 2), or more prompts)" in msg
    conf, acc, n_valid, row = record_steps(target, drafter, [[1, 2, 3], [4, 5]], 6, 32)
    assert conf.shape == (len(acc), dcfg.block_size - 1) and len(acc) == len(n_valid) == len(row) > 0


def test_calibrate_depth_says_which_file_it_writes_and_refuses_a_read_only_one(tmp_path, monkeypatch):
    """--help names the shipped drafter's config.json that calibrate-depth rewrites; a file or folder
    that cannot be written is a DFlashError naming it and --no-write (checked before decoding)."""
    from dflash_jax.assets.default_model import DRAFTERS_DIR
    from dflash_jax.cli import calibrate_depth
    from dflash_jax.errors import DFlashError

    page = calibrate_depth.add_arguments(cli.Parser(prog="dflash-jax calibrate-depth", **calibrate_depth.PARSER_TEXT)).format_help()
    shipped = sorted(DRAFTERS_DIR.glob("*/config.json"))
    assert len(shipped) == 1 and f"Without --no-write it rewrites {shipped[0]}\n" in page
    config = tmp_path / "config.json"
    config.write_text("{}", encoding="utf-8")
    calibrate_depth.check_writable(config)  # writable: no error
    monkeypatch.setattr(calibrate_depth.os, "access", lambda path, mode: Path(path) != tmp_path)  # the folder is read-only
    with pytest.raises(DFlashError) as e:
        calibrate_depth.check_writable(config)
    assert str(e.value) == (f"{config}: not writable (the shipped drafter's config.json, inside the installed package) "
                            "(expected write access to it and its folder, or --no-write to only print the fit)")


def test_help_pages_of_make_data_train_and_calibrate_depth_show_no_sphinx_markup(capsys):
    """The --help pages built from module docstrings (cli.options.help_text) carry no roles, no
    double backticks and no literal-block ``::``; the roles' targets stay readable."""
    from dflash_jax.cli.options import help_text

    got = help_text("Title of ``x``.\n\nSee :mod:`a.b`, :func:`~a.b.c` and ``--opt``. Examples::\n\n    run it\n")
    assert got["description"] == "Title of x." and got["epilog"] == "See a.b, c and --opt. Examples:\n\n    run it\n"
    for name in ("train", "make-data", "calibrate-depth"):
        code, out, _ = run(capsys, name, "--help")
        assert code == 0 and "`" not in out and ":mod:" not in out and "::\n" not in out, out
    code, out, _ = run(capsys, "make-data", "--help")
    assert "Two recipes (dflash_jax.train.make_data), chosen by who writes the answers:" in out
