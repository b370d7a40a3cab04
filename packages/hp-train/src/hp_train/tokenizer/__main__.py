"""``python -m hp_train.tokenizer``: see :mod:`hp_train.tokenizer.cli`."""

import sys

from hp_train.tokenizer.cli import main

sys.exit(main())
