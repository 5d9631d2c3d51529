"""Training DFlash drafters in JAX (``docs/specs/dflash.md`` section 3).

Modules:

* :mod:`dflash_jax.train.objective` -- the pure loss: random anchors, block inputs, labels at each
  slot's own position, context strictly before the anchor, position-decayed cross-entropy;
* :mod:`dflash_jax.train.data` -- token-id datasets with loss masks, target-feature capture and
  cache, deterministic batches;
* :mod:`dflash_jax.train.trainer` -- AdamW with warmup and decay, the jitted step, tau
  evaluation with the speculative loop, exact-resume checkpoints;
* :mod:`dflash_jax.train.export` -- writing the z-lab checkpoint layout;
* :mod:`dflash_jax.train.cli` -- ``dflash-jax train`` (:func:`dflash_jax.train.cli.main`).
"""
