"""Checkpoints (torch.distributed.checkpoint), export, and Hugging Face import and export;
``python -m hp_train.checkpoint mark-legacy DIR`` marks a checkpoint written before manifests
existed, the only kind that loads without one (:mod:`hp_train.checkpoint.__main__`)."""
