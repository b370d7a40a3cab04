"""``python -m hp_train.data.tokenizer``: see :mod:`hp_train.data.tokenizer.cli`."""

import sys

from hp_train.data.tokenizer.cli import main

sys.exit(main())
