"""``python -m dflash_jax.train ...``: the same as ``dflash-jax train ...``."""

import sys

from dflash_jax.train.cli import main

sys.exit(main())
