"""hp-train's front end to the planner's pricing: ``hp-dryrun`` / ``python -m hp_train.dryrun``.

The pricing itself (memory, collectives, timeline, layout search, paper reproduction) is
:mod:`hp_planner.price`, which reads a :class:`hp_planner.JobPlan` and never imports hp-train.
This package gives it the trainer's models (:class:`TrainerModel`: the trainer's stage cuts,
styles, optimizer split, fits check and refused pairs, :mod:`~hp_train.dryrun.refusals`), the
trainer's options as the command line (:mod:`~hp_train.dryrun.cli`) and the per-rank figures
the integration tests compare with a measured run (:func:`predict_for_run`).
"""

from hp_train.dryrun.predict import PREDICTED_KINDS, Prediction, predict_for_run
from hp_train.dryrun.refusals import check_runtime_accepts
from hp_train.dryrun.trainer_model import TrainerModel

__all__ = [
    "PREDICTED_KINDS",
    "Prediction",
    "TrainerModel",
    "check_runtime_accepts",
    "predict_for_run",
]
