"""Laying a model out over the ranks: the plan of the run, TP, CP, EP, the pipeline, FSDP,
activations and precision."""
