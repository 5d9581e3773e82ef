"""The checkpoint format: the run folder's layout, checksums, a save's writes; `python -m pretrain.checkpoint`."""
