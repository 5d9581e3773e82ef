"""Host to device: uint8 pixels converted and mixed where the batch is used give the model the same numbers as float
rows from the loader (`data.normalize_on`). On CPU the "device" is the host, so the arithmetic is the one a GPU
runs; the pinned, asynchronous copy itself runs in the GPU test below.
"""

from __future__ import annotations

import pytest
import torch

from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.step_pool import step_pool_bytes
from data_pipeline.stream.train_stream import TrainStream
from pretrain.feed import STAGING_SLOTS, DeviceFeed
from tests.data_pipeline.test_stream import make_shards

# A step: 8 images in 4 chunks of 2 (mixup pairs images within a chunk), 2 micro-batches of 4 whole chunks each
ORDER = dict(micro_batch_size=4, global_batch_size=8, streams=4, image_size=16, seed=5, shuffle_buffer=8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("feed") / "train")


def _stream(root, pixels: str, **kw) -> TrainStream:
    config = DataConfig.for_stream(root, **{**ORDER, **kw})
    return TrainStream(config, pixels=pixels)


def _batches(stream: TrainStream, feed: DeviceFeed, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(stream)
    return [tuple(t.clone() for t in feed(next(it))) for _ in range(n)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "settings",
    [
        dict(num_workers=2, augment=AugmentConfig(), mixup_alpha=0.4),  # what a recipe runs: workers, augment, mixup
        dict(num_workers=0, augment=AugmentConfig(), mixup_alpha=0.4, streams=2, micro_batch_size=2),  # c = 4 > m
        dict(num_workers=2, augment=None, mixup_alpha=0.0),
    ],
    ids=["workers-mixup", "chunks-span-micro-batches", "plain"],
)
def test_uint8_batches_normalized_on_the_device_equal_the_loaders_floats(shards, settings, dtype):
    """1.5 epochs: every micro-batch the model gets, images in its dtype and soft targets, bit-identical."""
    loader, device = _stream(shards, "float", **settings), _stream(shards, "uint8", **settings)
    n = 3 * loader.steps_in_epoch(0) // 2 * loader.accumulation_steps
    cpu = torch.device("cpu")
    expected = _batches(loader, DeviceFeed(cpu, dtype), n)
    for stage in (False, True):
        got = _batches(_stream(shards, "uint8", **settings), DeviceFeed(cpu, dtype, stage=stage), n)
        for i, ((x1, y1), (x2, y2)) in enumerate(zip(expected, got)):
            assert x2.dtype == dtype and torch.equal(x1, x2) and torch.equal(y1, y2), (i, stage)
    assert device.pixels == "uint8" and device.steps_in_epoch(0) == loader.steps_in_epoch(0)


def test_a_uint8_pool_is_a_quarter_of_the_float_one_and_the_setting_is_checked():
    assert step_pool_bytes(64, 224, 8, pixels="uint8") * 4 == step_pool_bytes(64, 224, 8)
    data = DataConfig()
    assert (data.pixels_for("cuda"), data.pixels_for("cpu")) == ("uint8", "float")  # auto
    assert DataConfig(normalize_on="device").pixels_for("cpu") == "uint8"
    assert DataConfig(normalize_on="loader").pixels_for("cuda") == "float"
    with pytest.raises(ValueError, match=r"data.normalize_on='gpu' must be one of auto, loader, device"):
        DataConfig(normalize_on="gpu")


def test_staging_buffers_are_reused_and_remade_for_a_new_shape():
    """Two host buffers per kind take turns (one is copied while the next is filled); a new batch shape (a resolution
    switch) replaces them."""
    feed = DeviceFeed(torch.device("cpu"), torch.float32, stage=True)
    labels = torch.zeros(2, dtype=torch.int64)
    made = []
    for i in range(5):
        pixels = torch.full((2, 3, 4, 4), i, dtype=torch.uint8)
        images, _ = feed((pixels, labels, None))
        assert torch.equal(images, torch.full((2, 3, 4, 4), i / 127.5 - 1.0))
        made += [b.data_ptr() for b in feed.staged_buffers("images")]
    assert len(set(made)) == STAGING_SLOTS
    feed((torch.zeros((2, 3, 8, 8), dtype=torch.uint8), labels, None))
    assert feed.staged_buffers("images")[-1].shape == (2, 3, 8, 8)


@pytest.mark.gpu
def test_on_a_gpu_pinned_uint8_copies_give_the_hosts_numbers(shards):
    settings = dict(num_workers=2, augment=AugmentConfig(), mixup_alpha=0.4)
    loader = _stream(shards, "float", **settings)
    n = 2 * loader.accumulation_steps * loader.steps_in_epoch(0)
    expected = _batches(loader, DeviceFeed(torch.device("cpu"), torch.bfloat16), n)
    feed = DeviceFeed(torch.device("cuda"), torch.bfloat16)
    assert feed.pin
    got = _batches(_stream(shards, "uint8", **settings), feed, n)
    assert all(b.is_pinned() for b in feed.staged_buffers("images"))
    for (x1, y1), (x2, y2) in zip(expected, got):
        assert torch.equal(x1, x2.cpu()) and torch.equal(y1, y2.cpu())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_losses_are_bit_identical_with_pixels_normalized_on_the_device(
    tiny_fractal_shards, train_cli, tmp_path
):
    """The trainer's path (`Trainer` -> `DeviceFeed`) with loader workers, augmentation, mixup, dropout and two
    micro-batches a step, in the precision this CPU picks: the same losses whichever side converts the pixels."""
    from pretrain.config.train_config import load_config

    losses = {}
    for where in ("loader", "device"):
        config = load_config(
            "local_demo",
            [
                f"data.train={tiny_fractal_shards}",
                "data.builtin=null",
                "data.global_batch_size=8",
                "data.micro_batch_size=4",
                "data.streams=4",
                "data.num_workers=2",
                "data.mixup_alpha=0.2",
                f"data.normalize_on={where}",
                "model.dropout=0.1",
                "schedule.total=4",
                "schedule.warmup=1",
                "logging.progress_bar=false",
                f"checkpoint.dir={tmp_path / where}",
            ],
        )
        losses[where] = train_cli(config, tmp_path / where)["losses"]
    assert len(losses["loader"]) == 4 and losses["device"] == losses["loader"], losses
