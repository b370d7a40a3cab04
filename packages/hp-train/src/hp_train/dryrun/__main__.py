"""``python -m hp_train.dryrun``: the dry-run planner's command line."""

from hp_train.dryrun.cli import main

raise SystemExit(main())
