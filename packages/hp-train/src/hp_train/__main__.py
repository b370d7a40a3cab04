"""``python -m hp_train``: the training entry point (see :mod:`hp_train.config.cli`)."""

import logging
import os
import sys

from hp_train.config.cli import main

code = main()
# main has shut the process groups down and closed its files. Leave without the interpreter's
# finalization: gloo's worker threads can still hold work objects whose tensors Python frees
# then, and a rank aborted there (SIGABRT, "terminate called without an active exception")
# after a clean NonFiniteError stop, replacing its exit code 3 with -6.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
