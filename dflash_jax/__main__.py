"""``python -m dflash_jax`` runs the ``dflash-jax`` command line."""

import sys

from dflash_jax.cli import main

sys.exit(main())
