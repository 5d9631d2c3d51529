"""Training DFlash drafters in JAX (``docs/specs/dflash.md`` section 3).

Modules:

* :mod:`dflash_jax.train.objective` -- the pure loss: random anchors, block inputs, labels at each
  slot's own position, context strictly before the anchor, position-decayed cross-entropy;
* :mod:`dflash_jax.train.dataset` -- token-id datasets with loss masks;
* :mod:`dflash_jax.train.features` -- target-feature capture, its on-disk cache, fingerprints;
* :mod:`dflash_jax.train.data` -- deterministic batches (and the two modules above, re-exported);
* :mod:`dflash_jax.train.optim` -- training settings, AdamW with warmup and decay;
* :mod:`dflash_jax.train.step` -- the training state and the jitted step;
* :mod:`dflash_jax.train.mesh` -- the step on a device mesh, over one process or several;
* :mod:`dflash_jax.train.checkpoint` -- exact-resume checkpoints (orbax);
* :mod:`dflash_jax.train.evaluation` -- tau with the speculative loop, the training curve;
* :mod:`dflash_jax.train.trainer` -- the driver that runs, pauses and resumes a run;
* :mod:`dflash_jax.train.export` -- writing the z-lab checkpoint layout;
* :mod:`dflash_jax.train.make_data` -- self-distillation datasets (``dflash-jax make-data``), with
  :mod:`dflash_jax.train.prompt_lists` (the prompts) and :mod:`dflash_jax.train.source_code`
  (real functions answered with their source);
* :mod:`dflash_jax.cli.train` -- ``dflash-jax train`` (:func:`dflash_jax.cli.train.main`).
"""
