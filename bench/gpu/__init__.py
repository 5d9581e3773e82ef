"""The GPU campaign on a lent GPU (`python -m bench.gpu`)."""
