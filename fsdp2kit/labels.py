"""The label value of a position that is no loss target: torch's cross_entropy default `ignore_index`, which
transformers uses too. The data pipeline writes it, sequence parallel pads with it, the loss and log-probs skip it."""

IGNORE_INDEX = -100
