"""``python -m hp_train``: the training entry point (see :mod:`hp_train.config.cli`)."""

import sys

from hp_train.config.cli import main

sys.exit(main())
