"""The models the trainer builds: the Llama family, dense and MoE."""
