"""The GPU campaign (`python -m bench.gpu`): the step, the real path, the loader and the plan, on a lent GPU."""
