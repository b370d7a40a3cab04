"""Fast recovery: in-memory snapshots replicated across hosts, the restart that takes them,
and the checkpoint written on SIGTERM or SIGINT.

* :mod:`~hp_train.recovery.plan`: which step and source a restarted job takes (pure).
* :mod:`~hp_train.recovery.snapshot_file`: one rank's snapshot as files, written atomically.
* :mod:`~hp_train.recovery.state`: a rank's training state as raw bytes and back.
* :mod:`~hp_train.recovery.transfer`: snapshots between ranks, point to point.
* :mod:`~hp_train.recovery.keeper`: periodic snapshots, written and replicated in the
  background.
* :mod:`~hp_train.recovery.recover`: a restarted job's restore, falling back source by source.
* :mod:`~hp_train.recovery.setup`: the snapshot folder, the host, the run id.
* :mod:`~hp_train.recovery.signals`: the dying-gasp checkpoint.
"""
