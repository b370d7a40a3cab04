"""Checkpoints (torch.distributed.checkpoint), export, and Hugging Face import and export."""
