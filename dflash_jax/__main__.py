"""``python -m dflash_jax`` runs the ``dflash-jax`` command line."""

from dflash_jax.cli import entry

entry()
