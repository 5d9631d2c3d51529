"""``python -m dflash_jax`` runs the ``dflash-jax`` command line."""

from dflash_jax.cli.main import entry

entry()
