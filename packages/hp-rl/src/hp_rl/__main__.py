"""``python -m hp_rl``: see :mod:`hp_rl.cli`."""

import sys

from hp_rl.cli import main

sys.exit(main())
