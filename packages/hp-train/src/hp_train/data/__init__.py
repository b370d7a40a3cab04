"""The data pipeline: sources, documents, packing, order and the tokenizers."""
