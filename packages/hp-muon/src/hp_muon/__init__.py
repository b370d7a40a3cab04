"""hp_muon: layout-driven distributed Muon, usable with any sharder.

``Muon`` computes ``torch.optim.Muon``'s update; across ranks, each matrix is orthogonalized
exactly once by an owner chosen from the parameters' layouts (``hp_dtensor.layout_of``), with
pieces gathered and results scattered in one bf16 all-to-all each way per bucket.
"""

from hp_muon.chained import ChainedOptimizer, ParamSplit, muon_with_adamw, split_params
from hp_muon.checks import FLAT_LAYOUT_HINT, check_muon_params, flat_pieces_of_matrices
from hp_muon.coefficients import KELLER, PRESETS, coefficient_schedule
from hp_muon.muon import Muon, MuonStepStats, adjusted_lr
from hp_muon.newton_schulz import (
    orthogonalize,
    orthogonalize_batch,
    orthogonalize_counted,
    orthogonalize_many,
)
from hp_muon.nonfinite import NonFiniteGradientError, NonFinitePolicy
from hp_muon.plan import MatrixTensor, MuonPlan, MuonPlanError, plan_muon_step
from hp_muon.step_plan import MuonGroupPlan, MuonStepPlan, plan_muon

__version__ = "0.1.0"

__all__ = [
    "FLAT_LAYOUT_HINT",
    "KELLER",
    "PRESETS",
    "ChainedOptimizer",
    "MatrixTensor",
    "Muon",
    "MuonGroupPlan",
    "MuonPlan",
    "MuonPlanError",
    "MuonStepPlan",
    "MuonStepStats",
    "NonFiniteGradientError",
    "NonFinitePolicy",
    "ParamSplit",
    "__version__",
    "adjusted_lr",
    "check_muon_params",
    "coefficient_schedule",
    "flat_pieces_of_matrices",
    "muon_with_adamw",
    "orthogonalize",
    "orthogonalize_batch",
    "orthogonalize_counted",
    "orthogonalize_many",
    "plan_muon",
    "plan_muon_step",
    "split_params",
]
