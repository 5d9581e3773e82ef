"""What a forward keeps for backward, per image, measured on a real module (the planner's memory tests)."""

from __future__ import annotations

import torch


def saved_bytes_per_image(module, image_size: int, dtype=torch.float32) -> float:
    """Saved tensors' bytes, each storage once, of a forward at batch 2 less batch 1; the backward they serve runs."""
    held = []
    for batch in (1, 2):
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(torch.randn(batch, 3, image_size, image_size, dtype=dtype))
        out.float().square().mean().backward()
        held.append(sum(storages.values()))
    return held[1] - held[0]
