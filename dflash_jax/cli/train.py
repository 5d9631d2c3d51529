"""``dflash-jax train``: trains a DFlash drafter for a target on a self-distillation dataset.

Example (the first of the eight runs that made the shipped SmolLM2 drafter;
``tools/train_default_drafter.sh`` in the source repository runs them all, ``dflash_jax/assets/drafters/smollm2-135m-instruct``)::

    dflash-jax make-data --out runs/smollm2/data1 --num-prompts 2193
    dflash-jax train --data runs/smollm2/data1 --out runs/smollm2/run1 --mask-token-id 16 \\
        --layers 2 --target-layer-ids 1,10,18,27 --block-size 8 --draft-vocab 8192 \\
        --batch-size 16 --max-len 288 --num-anchors 16 --steps 1500 --lr 8e-4

Rerunning the same command resumes from the newest checkpoint in ``--out`` (the settings must
be the same); ``--time-limit`` / ``--stop-at`` pause a run so that no single command has to run
for long. When the last step is done the drafter is exported in the z-lab layout to
``--export`` (default ``<out>/drafter``) with ``training_curve.csv`` (tau versus training tokens).

Beyond one device: ``--mesh data=D,model=M`` runs each step on a device mesh (rows of the batch
over data, the drafter's and the target's heads and MLP over model); with ``--coordinator
HOST:PORT --num-processes N --process-id I`` every process runs the same command, reads its own
rows and writes its shards of each checkpoint; process 0 prints, logs and exports.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.cli.options import (
    Parser,
    add_process_options,
    add_weights_option,
    choices_metavar,
    help_text,
    int_list,
    integer,
    number,
    one_line,
    one_of,
    parse_and_run,
)
from dflash_jax.errors import DFlashError, option_error
from dflash_jax.train.optim import COMPUTE_DTYPES, DECAYS


EXPORT_DTYPES = ("bfloat16", "float16", "float32")


PARSER_TEXT = help_text(__doc__)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dflash-jax train`` on its own (``python -m dflash_jax.train``)."""
    return add_arguments(Parser(prog="dflash-jax train", **PARSER_TEXT))


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the options of ``dflash-jax train`` to ``ap`` (its own parser, or the ``train``
    subparser of ``dflash-jax``); returns ``ap``."""
    g = ap.add_argument_group("data and target")
    g.add_argument("--data", required=True, help="dataset folder (dflash-jax make-data, TokenDataset)")
    g.add_argument("--out", required=True, help="run folder: checkpoints, logs, tau curve (resumed when it exists)")
    g.add_argument("--target", default=None, help="target .gguf or HF folder (default: embedded SmolLM2-135M-Instruct)")
    add_weights_option(g)
    g.add_argument("--features", default=None, help="target-feature cache folder (default <out>/features; built when missing)")
    g.add_argument("--no-feature-cache", action="store_true", help="recompute target features in every step instead")
    g.add_argument("--labels", type=one_of("data", "target"), metavar=choices_metavar("data", "target"), default="data",
                   help="what each block slot learns: the data's token (default; self-distilled answers are the target's "
                        "greedy output) or the target's greedy next token after the data's prefix (for text the target "
                        "did not write, e.g. source code; needs the feature cache, which then also stores next tokens)")
    g = ap.add_argument_group("drafter (defaults follow the target)")
    g.add_argument("--layers", type=integer, default=2, help="draft layers (default 2)")
    g.add_argument("--target-layer-ids", type=int_list, default=None,
                   help="captured target layers, e.g. 1,10,18,27 (default: z-lab's spread for --layers taps)")
    g.add_argument("--mask-token-id", type=integer, required=True,
                   help="id of the block's MASK token: a row of the target embedding that never appears in the data "
                        "(an unused special token)")
    g.add_argument("--block-size", type=integer, default=16, help="training block size (default 16)")
    g.add_argument("--intermediate-size", type=integer, default=None, help="MLP width (default: the target's)")
    g.add_argument("--causal", action="store_true", help="causal attention inside the block (default bidirectional)")
    g.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from this drafter's weights (z-lab folder) instead of random ones, e.g. to continue "
                        "a shipped drafter on more data; its layers, taps, MLP width, mask id, block size and block "
                        "attention must equal this run's")
    g = ap.add_argument_group("optimisation (docs/specs/dflash.md 3.7)")
    g.add_argument("--steps", type=integer, default=1000, help="optimizer steps in all, the schedule's length (default 1000)")
    g.add_argument("--batch-size", type=integer, default=8, help="sequences per step (default 8)")
    g.add_argument("--max-len", type=integer, default=512, help="padded sequence length; longer sequences are truncated")
    g.add_argument("--num-anchors", type=integer, default=32, help="blocks per sequence (default 32)")
    g.add_argument("--gamma", type=number, default=None, help="loss decay (default 7 for block 16, 5 for 10, 4 for 8; <= 0: none)")
    g.add_argument("--draft-vocab", type=integer, default=0,
                   help="train and draft over the N tokens most frequent in the responses (default 0: the whole vocabulary)")
    g.add_argument("--lr", type=number, default=6e-4, help="peak learning rate of AdamW (default 6e-4)")
    g.add_argument("--warmup-ratio", type=number, default=0.04, help="fraction of --steps of linear warmup from 0 (default 0.04)")
    g.add_argument("--decay", type=one_of(*DECAYS), metavar=choices_metavar(*DECAYS), default="cosine",
                   help="learning-rate decay after warmup, down to lr * --final-lr-ratio (default cosine)")
    g.add_argument("--final-lr-ratio", type=number, default=0.0, help="final learning rate as a fraction of --lr (default 0)")
    g.add_argument("--weight-decay", type=number, default=0.01, help="AdamW decoupled weight decay (default 0.01)")
    g.add_argument("--grad-clip", type=number, default=1.0, help="global gradient-norm clip, 0: off (default 1.0)")
    g.add_argument("--dtype", type=one_of(*COMPUTE_DTYPES), metavar=choices_metavar(*COMPUTE_DTYPES), default="float32", help="compute dtype (master weights float32)")
    g.add_argument("--seed", type=integer, default=0, help="seed of initialisation, anchor sampling and data order (default 0)")
    g = ap.add_argument_group("run")
    g.add_argument("--ckpt-every", type=integer, default=100, help="steps between checkpoints (default 100)")
    g.add_argument("--keep", type=integer, default=3, help="checkpoints kept (default 3)")
    g.add_argument("--eval-every", type=integer, default=0, help="steps between tau evaluations (0: start and end only)")
    g.add_argument("--eval-prompts", default=None, help="JSON with 'ids' or 'texts' (default <data>/eval_prompts.json)")
    g.add_argument("--eval-max-new", type=integer, default=64, help="new tokens per prompt in a tau evaluation (default 64)")
    g.add_argument("--time-limit", type=number, default=None, help="minutes; checkpoint and stop after this")
    g.add_argument("--stop-at", type=integer, default=None, help="checkpoint and stop after this step")
    g.add_argument("--export", default=None, help="exported drafter folder (default <out>/drafter)")
    g.add_argument("--export-dtype", type=one_of(*EXPORT_DTYPES), metavar=choices_metavar(*EXPORT_DTYPES), default="bfloat16",
                   help="dtype of the exported drafter's weights (default bfloat16)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (feature caching, training) on stderr")
    g = ap.add_argument_group("devices and processes")
    g.add_argument("--mesh", metavar="AXES", default=None,
                   help="train on a device mesh, e.g. data=2 or data=2,model=2 (batch rows over data, heads and MLP width over "
                   "model; --batch-size a multiple of data; default: one device)")
    add_process_options(g, "prints and writes the logs and the export")
    return ap


def default_layer_ids(num_target_layers: int, n: int) -> tuple:
    """z-lab's spread of ``n`` captured layers over ``[1, L - 3]`` (``build_target_layer_ids``)."""
    if n == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (n - 1))) for i in range(n))


def default_gamma(block_size: int) -> float:
    """Paper defaults (``docs/specs/dflash.md`` 3.6): 7 for B=16, 5 for B=10, 4 for B=8; else B/2.3."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, round(block_size / 2.3, 2))


def drafter_config_for(target_cfg, layers: int, layer_ids, mask_token_id: int, block_size: int, intermediate_size=None, causal=False):
    """A generic DFlash drafter config sized like ``target_cfg`` (hidden size, heads, head dim,
    MLP width, norm eps and RoPE of the target).

    Raises:
      DFlashError: fewer than one layer, a block size below 2, repeated or out-of-range layer ids
        (also when ``layers`` default ids would repeat), or a mask id outside the target's
        vocabulary (names the option).
    """
    from dflash_jax.drafter.config import DrafterConfig, check_drafter_fits

    if int(layers) < 1:
        raise DFlashError("--layers", f"got {layers}", "an integer >= 1")
    if int(block_size) < 2:
        raise DFlashError("--block-size", f"got {block_size}", "an integer >= 2 (the anchor and at least one MASK slot)")
    given = bool(layer_ids)
    layer_ids = tuple(layer_ids) if given else default_layer_ids(target_cfg.num_hidden_layers, layers)
    if len(set(layer_ids)) != len(layer_ids):
        if given:
            raise DFlashError("--target-layer-ids", f"repeats an id: {','.join(map(str, layer_ids))}", "distinct target layer ids")
        raise DFlashError("--layers", f"{layers} captured layers spread over a target of {target_cfg.num_hidden_layers} would repeat ids",
                          "fewer layers, or distinct --target-layer-ids")
    cfg = DrafterConfig(
        hidden_size=target_cfg.hidden_size, intermediate_size=int(intermediate_size or target_cfg.intermediate_size),
        num_hidden_layers=int(layers), num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads, head_dim=target_cfg.head_dim, vocab_size=target_cfg.vocab_size,
        block_size=int(block_size), mask_token_id=int(mask_token_id), target_layer_ids=layer_ids,
        num_target_layers=target_cfg.num_hidden_layers, layer_causal=(bool(causal),) * int(layers), layer_window=(0,) * int(layers),
        rms_norm_eps=target_cfg.rms_norm_eps, rope=target_cfg.rope,
    )
    check_drafter_fits(cfg, target_cfg, source="dflash-jax train")
    return cfg


def init_weights(path, target_cfg, cfg):
    """Float32 weights of the drafter at ``path`` (z-lab folder) to start training ``cfg`` from.

    Raises:
      DFlashError: a drafter that does not load for the target, or whose layers, captured target
        layers, MLP width, mask token id, block size or block attention differ from this run's
        (names the option, this run's value and the drafter's).
    """
    from dflash_jax.drafter.model import load_hf_drafter

    got, params = load_hf_drafter(path, target_cfg, dtype="float32")
    show = {"target_layer_ids": lambda v: ",".join(map(str, v)), "layer_causal": lambda v: "given" if all(v) else "not given"}
    for field, flag in (("num_hidden_layers", "--layers"), ("target_layer_ids", "--target-layer-ids"),
                        ("intermediate_size", "--intermediate-size"), ("mask_token_id", "--mask-token-id"),
                        ("block_size", "--block-size"), ("layer_causal", "--causal")):
        mine, theirs = getattr(cfg, field), getattr(got, field)
        if mine != theirs:
            fmt = show.get(field, str)
            raise DFlashError(flag, fmt(mine), f"{fmt(theirs)}, as in {Path(path) / 'config.json'} (the drafter given to --init-from)")
    return params


def _init_record(path, params) -> dict:
    """What an exported drafter records about the drafter it was continued from."""
    from dflash_jax.train.step import params_fingerprint

    p = Path(path)
    try:
        rec = json.loads((p / "config.json").read_text(encoding="utf-8")).get("dflash_jax", {})
    except (OSError, ValueError):
        rec = {}
    return {"drafter": p.name, "weights": params_fingerprint(params), "dataset": rec.get("dataset"), "steps": rec.get("steps"),
            "tokens_seen": rec.get("tokens_seen")}


def load_eval_prompts(path, tokenizer) -> list[list[int]]:
    """Evaluation prompts from a JSON file: ``{"ids": [[...], ...]}``, ``{"texts": [...]}`` or a
    list of strings (texts are rendered with the target's chat template as one user turn)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict) and data.get("ids"):
        return [list(map(int, x)) for x in data["ids"]]
    texts = data.get("texts") if isinstance(data, dict) else data
    if not texts or tokenizer is None:
        raise DFlashError(str(path), "no 'ids' (or 'texts' with a tokenizer)", "evaluation prompts")
    return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def main(argv=None) -> int:
    """Runs ``dflash-jax train``; returns the exit status (0 finished or paused, 2 bad input).

    Args:
      argv: arguments without the program and subcommand names (default ``sys.argv[1:]``).
    """
    return parse_and_run(build_parser, run, argv)


def run(args, argv) -> int:
    """Trains with parsed ``args`` (``argv``: the arguments as given, recorded with the export);
    returns 0, or 2 after printing a one-line error for bad input."""
    from dflash_jax.runtime import distributed

    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before anything else uses JAX
        return _run(args, argv)
    except DFlashError as e:
        print(f"error: {one_line(option_error(e))}", file=sys.stderr)
        return 2


def _features(args, out: Path, ds, target, cfg):
    """The target-feature cache of ``--features`` / ``<out>/features`` (built when missing or
    unusable; with several processes process 0 builds it on its own devices while the others
    wait, then they read it), or ``None`` with ``--no-feature-cache``."""
    import jax

    from dflash_jax.runtime import distributed
    from dflash_jax.train.features import FeatureCache, target_fingerprint

    if args.no_feature_cache:
        return None
    fdir = Path(args.features) if args.features else out / "features"
    fp = target_fingerprint(target.cfg, target.params)

    def load():
        try:
            f = FeatureCache.load(fdir, ds, cfg.target_layer_ids, target=fp)
            return None if args.labels == "target" and f.next_tokens is None else f
        except (DFlashError, FileNotFoundError):
            return None

    features = load()
    if jax.process_count() > 1 and not distributed.everywhere(features is not None):
        built = distributed.Broadcast("dflash_jax/train/features")  # a wait of any length (a collective would time out)
        if distributed.is_leader():
            if features is None:
                _build_features(args, fdir, ds, target, cfg)
            built.send(True)
        else:
            built.receive()
        features = load()
        if features is None:
            raise DFlashError(str(fdir), "not readable by every process after process 0 built it", "a folder all processes share")
    elif features is None:
        features = _build_features(args, fdir, ds, target, cfg)
    return features


def _build_features(args, fdir: Path, ds, target, cfg):
    from dflash_jax.train.features import cache_features

    return cache_features(target.params, target.cfg, ds, cfg.target_layer_ids, fdir, post_norm_last=cfg.post_norm_last,
                          next_tokens=args.labels == "target", progress=not args.no_progress)


def _run(args, argv) -> int:
    from dflash_jax.runtime import distributed
    from dflash_jax.loading import load_target
    from dflash_jax.nn.module import tree_of
    from dflash_jax.runtime.sharding import describe, parse_mesh
    from dflash_jax.train.data import Batcher, count_valid_anchors
    from dflash_jax.train.dataset import TokenDataset
    from dflash_jax.train.mesh import check_batch_size
    from dflash_jax.train.optim import TrainConfig
    from dflash_jax.train.trainer import train

    mesh = None if args.mesh is None else parse_mesh(args.mesh)
    if mesh is not None:
        check_batch_size(mesh, args.batch_size)  # before anything loads
    leader, out = distributed.is_leader(), Path(args.out)
    ds = TokenDataset.load(args.data)  # before the target: a bad --data fails in a moment
    target = load_target(args.target, weights=args.weights)
    cfg = drafter_config_for(target.cfg, args.layers, args.target_layer_ids, args.mask_token_id, args.block_size,
                             args.intermediate_size, args.causal)
    export = Path(args.export or out / "drafter")
    if args.init_from and Path(args.init_from).resolve() == export.resolve():
        raise DFlashError("--export", str(export), "a folder other than --init-from's (a rerun would continue other weights)")
    init_params = init_weights(args.init_from, target.cfg, cfg) if args.init_from else None
    if leader and (ds.tokens == cfg.mask_token_id).any():
        print(f"warning: the mask token id {cfg.mask_token_id} occurs in the data", file=sys.stderr)
    gamma = args.gamma if args.gamma is not None else default_gamma(cfg.block_size)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, num_anchors=args.num_anchors, gamma=gamma, draft_vocab=args.draft_vocab,
                     lr=args.lr, warmup_ratio=args.warmup_ratio, decay=args.decay, final_lr_ratio=args.final_lr_ratio,
                     weight_decay=args.weight_decay, grad_clip=args.grad_clip, compute_dtype=args.dtype, seed=args.seed)
    batcher = Batcher(ds, tc.batch_size, tc.max_len, seed=tc.seed, features=_features(args, out, ds, target, cfg), labels=args.labels)
    if leader:
        print(f"data: {len(batcher)} sequences, {int(ds.lengths.sum())} tokens, {count_valid_anchors(ds, tc.max_len)} anchor positions; "
              f"drafter: {cfg.num_hidden_layers} layers, taps {list(cfg.target_layer_ids)}, block {cfg.block_size}, mask id "
              f"{cfg.mask_token_id}" + (f"; mesh {describe(mesh)}" if mesh is not None else ""), file=sys.stderr)
    eval_path = args.eval_prompts or (Path(args.data) / "eval_prompts.json")
    eval_prompts = load_eval_prompts(eval_path, target.tokenizer) if Path(eval_path).is_file() else None
    t0 = time.time()
    state, summary = train(out, target_params=target.params, target_cfg=target.cfg, cfg=cfg, batcher=batcher, tc=tc,
                           eval_prompts=eval_prompts, eval_max_new=args.eval_max_new,
                           eval_every=args.eval_every, stop_ids=target.eos_ids, ckpt_every=args.ckpt_every, keep=args.keep,
                           time_limit=None if args.time_limit is None else args.time_limit * 60.0, stop_at=args.stop_at,
                           progress=not args.no_progress, init_params=init_params, mesh=mesh)
    tau = summary.get("tau") or {}
    if leader:
        resumed = f"; resumed at step {summary['start']}" if summary["start"] else ""
        print(f"step {summary['step']}/{tc.steps} ({'finished' if summary['finished'] else 'paused'}){resumed}; "
              f"{summary['tokens_seen']} tokens seen; loss {summary['last'].get('loss')}; tau {tau.get('tau')}; "
              f"{time.time() - t0:.0f}s this run", file=sys.stderr)
    if summary["finished"]:
        params = distributed.fetch(tree_of(state.params))  # the module's state as its tree; a collective: every process
        if leader:
            _export(args, argv, export, target, cfg, ds, batcher, summary, gamma, init_params, params)
    return 0


def _export(args, argv, export: Path, target, cfg, ds, batcher, summary: dict, gamma: float, init_params, params) -> None:
    """Exports the trained drafter (``params``, host arrays) to ``export`` with its records and
    training curve."""
    from dflash_jax.loading import fingerprint_of
    from dflash_jax.train.evaluation import write_training_curve
    from dflash_jax.train.export import export_drafter

    tau = summary.get("tau") or {}
    mask_text = target.tokenizer.decode([cfg.mask_token_id]) if target.tokenizer is not None else None
    extra = {"dflash_jax": {
        "trained_with": "dflash-jax train " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "target": Path(str(target.source)).name, "target_fingerprint": fingerprint_of(target),
        "mask_token": mask_text, "dataset": ds.fingerprint(),
        "dataset_sequences": len(batcher), "tokens_seen": summary["tokens_seen"], "steps": summary["step"],
        "train_seconds": summary["seconds"], "tau_eval": tau.get("tau"), "gamma": gamma,
    }}
    if args.init_from:
        extra["dflash_jax"]["init_from"] = _init_record(args.init_from, init_params)
    ids = summary["draft_ids"]
    if ids is not None:
        extra["dflash_jax"]["draft_vocab"] = {"size": len(ids), "file": draft_vocab.FILE_NAME,
                                              "response_coverage": round(draft_vocab.coverage(ids, batcher.flat_labels(), ds.loss_mask), 5)}
    folder = export_drafter(export, cfg, params, args.export_dtype, extra, draft_ids=ids)
    write_training_curve(args.out, folder / "training_curve.csv",
                         before=Path(args.init_from) / "training_curve.csv" if args.init_from else None)
    print(f"exported the drafter to {folder}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
