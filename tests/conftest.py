"""Suite-wide settings: CPU DeepSpeed, GPU tests skipped with a reason when no CUDA device is present."""

import os

import pytest

# DeepSpeed picks its accelerator at import time; the suite runs on CPU unless a GPU test asks otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none on this machine); runs on the GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
