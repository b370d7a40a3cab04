"""hp_train: the hyper-parallel training entry point.

``torchrun --standalone --nproc-per-node 4 -m hp_train --dp-shard 2 --tp 2`` trains a
Llama-style model (dense or MoE) with FSDP x TP and Muon + AdamW on local CPU ranks; see
:mod:`hp_train.config.cli`. ``python -m hp_train.dryrun`` prices a configuration at any scale
without processes (:mod:`hp_planner.price` with the trainer's models).
"""

from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "__version__",
]
