"""Shards in a real GCS-compatible bucket (gcp-storage-emulator's JSON API on 127.0.0.1, the ``gcs_endpoint``
fixture in tests/conftest.py), read through gcsfs as any ``gs://`` data root is: the training stream, with loader
workers started as training starts them, yields the local copy's batches; the eval stream reads every sample.

The endpoint is set only after this process's fork server has started (its first forkserver loader): the workers
forked from it must still read with it (`data_pipeline.stream.loader._Environment`)."""

import fsspec
import pytest
import torch

from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.stream.train_stream import TrainStream
from tests.data_pipeline.test_stream import UNEVEN, make_shards


@pytest.mark.timeout(180)
def test_shards_in_a_gcs_bucket_stream_as_their_local_copy(gcs_endpoint, tmp_path, monkeypatch):
    root = make_shards(tmp_path / "s")
    gcs = fsspec.filesystem("gs")
    gcs.mkdir("vitscale-shards")
    gcs.put(str(root), "vitscale-shards/s", recursive=True)
    url = "gs://vitscale-shards/s"
    kw = dict(micro_batch_size=8, image_size=16, num_workers=2, shuffle_buffer=8)  # forkserver workers, the default
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")  # the fork server starts (at the latest) without the endpoint
    local = TrainStream(DataConfig.for_stream(root, **kw))
    expected = [b for _, b in zip(range(local.steps_per_epoch), local)]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    remote = TrainStream(DataConfig.for_stream(url, **kw, read_retries=0))  # a read that goes elsewhere fails
    assert remote.steps_per_epoch == local.steps_per_epoch > 0
    got = [b for _, b in zip(range(remote.steps_per_epoch), remote)]
    for (x, y), (lx, ly) in zip(got, expected, strict=True):
        assert torch.equal(x, lx) and torch.equal(y, ly)
    assert not remote.stats["read_failures"] and not remote.stats["truncated_shards"]

    stream = EvalStream(url, batch_size=16, image_size=16, return_keys=True)
    assert sorted(k for _, _, batch in stream for k in batch) == [f"{k:06d}" for k in range(sum(UNEVEN))]
