"""``python -m dflash_jax.train ...``: the same as ``dflash-jax train ...``."""

import sys

from dflash_jax.cli.train import main

sys.exit(main())
