"""Micro-batches onto the rank's device (docs/performance.md, "Host to device")."""

from __future__ import annotations

from collections import deque

import torch

from data_pipeline.stream.augment import float_images_on, mix
from data_pipeline.stream.train_stream import MixRows

STAGING_SLOTS = 2  # host buffers per kind: one copied while the next is filled


class DeviceFeed:
    """The stream's micro-batches as (images in ``dtype``, labels) on ``device``; ``stage``: copy uint8 pixels
    through reused host buffers (default: on a GPU, pinned)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, stage: bool | None = None):
        self.device, self.dtype = device, dtype
        self.stage = device.type == "cuda" if stage is None else stage
        self.pin = self.stage and device.type == "cuda"
        self._staging: dict[str, deque[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}

    def __call__(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch) == 2:  # float32
            images, labels = batch
            images = images.to(self.device, dtype=self.dtype, non_blocking=True)
            return images, labels.to(self.device, non_blocking=True)
        pixels, labels, mix_rows = batch
        images = float_images_on(self._host_to_device(pixels, "images"), self.device)
        if mix_rows is not None:
            self._mix(images, mix_rows)
        return images.to(self.dtype), labels.to(self.device, non_blocking=True)

    def _mix(self, images: torch.Tensor, rows: MixRows) -> None:
        """Mixup on the device, in place, as `augment.mixup` on the host."""
        partners = float_images_on(self._host_to_device(rows.partners, "partners"), self.device)
        for start, stop, lam in rows.spans:
            images[start:stop] = mix(images[start:stop], partners[start:stop], lam)

    def _host_to_device(self, host: torch.Tensor, kind: str) -> torch.Tensor:
        """``host`` through the oldest staging buffer of ``kind`` once its last copy is done; unstaged, as it is."""
        if not self.stage:
            return host
        ring = self._staging.setdefault(kind, deque())
        buffer = None
        if len(ring) == STAGING_SLOTS:
            buffer, done = ring.popleft()
            if done is not None:
                done.synchronize()
        if buffer is None or buffer.shape != host.shape:  # a partial batch, a resolution switch
            buffer = torch.empty(host.shape, dtype=host.dtype, pin_memory=self.pin)
        buffer.copy_(host)
        on_device = buffer.to(self.device, non_blocking=True)
        done = None
        if self.pin:
            done = torch.cuda.Event()
            done.record()
        ring.append((buffer, done))
        return on_device

    def staged_buffers(self, kind: str) -> list[torch.Tensor]:
        return [buffer for buffer, _ in self._staging.get(kind, ())]
