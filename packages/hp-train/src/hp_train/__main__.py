"""``python -m hp_train``: the training entry point (see :mod:`hp_train.cli`)."""

import sys

from hp_train.cli import main

sys.exit(main())
