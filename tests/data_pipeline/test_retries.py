"""Transient storage errors: a shard read that fails (EIO on open, EIO mid-read) is retried with backoff and counted;
only a read that keeps failing counts the shard as damaged. The storage is a real filesystem behind fsspec (the
project's own shards on local disk) reached through a test protocol, ``flaky://``, whose files fail their first N
opens: the data pipeline takes fsspec URLs, so this is the path an s3:// or gs:// read takes."""

from __future__ import annotations

import errno
import os
import sys
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from data_pipeline.manifest import ShardFormatError, read_dataset_info
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.stream.shards import is_transient, read_shard, refused, retry_delay_s
from data_pipeline.stream.train_stream import TrainStream
from pretrain.config.train_config import load_config
from tests.data_pipeline.test_stream import UNEVEN, make_shards


class _FailingReader:
    """A file that raises EIO once ``limit`` bytes have been read from it (a connection reset mid-read)."""

    def __init__(self, f: Any, limit: int, error: OSError | None = None):
        self.f, self.limit, self.done = f, limit, 0
        self.error = error or OSError(errno.EIO, "Input/output error (flaky:// test storage, mid-read)")

    def read(self, n: int = -1) -> bytes:
        if self.done >= self.limit:
            raise self.error
        data = self.f.read(n if n is not None and n >= 0 and n < self.limit - self.done else self.limit - self.done)
        self.done += len(data)
        return data

    def close(self) -> None:
        self.f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class FlakyFileSystem(LocalFileSystem):
    """Local files whose ``.tar`` files fail their first ``fail_opens`` opens: with EIO at open, or (with
    ``fail_after_bytes``) after that many bytes. The open counts live in files under ``state_dir``, so loader
    workers (forked processes) share them."""

    protocol = ("flaky",)
    cachable = False
    state_dir = ""
    fail_opens = 0
    fail_after_bytes: int | None = None
    mid_read_error: OSError | None = None  # raised after fail_after_bytes; None: EIO
    further_each_open = False  # the n-th open fails after n × fail_after_bytes

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if not str(path).endswith(".tar"):
            return f
        if (n := opens(path)) > self.fail_opens:
            return f
        if self.fail_after_bytes is None:
            f.close()
            raise OSError(errno.EIO, "Input/output error (flaky:// test storage)", str(path))
        limit = self.fail_after_bytes * (n if self.further_each_open else 1)
        return _FailingReader(f, limit, self.mid_read_error)


def opens(path: str) -> int:
    """Count one more open of ``path`` and return the count (an O_APPEND byte per open: safe across processes)."""
    counter = Path(FlakyFileSystem.state_dir) / (str(path).strip("/").replace("/", "_") + ".opens")
    fd = os.open(counter, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)
    return counter.stat().st_size


@pytest.fixture
def flaky(tmp_path, monkeypatch):
    """The ``flaky://`` protocol, registered for this test (and the loader workers it forks)."""
    state = tmp_path / "opens"
    state.mkdir()
    monkeypatch.setattr(FlakyFileSystem, "state_dir", str(state))
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    yield FlakyFileSystem
    sys.modules["fsspec.registry"]._registry.pop("flaky", None)  # fsspec.registry is a read-only view of it


def test_transient_errors_are_told_from_damage():
    assert is_transient(OSError(errno.EIO, "Input/output error"))
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    http_503 = type("ClientResponseError", (Exception,), {"status": 503})()  # aiohttp's, as an HTTP store raises it
    http_404 = type("ClientResponseError", (Exception,), {"status": 404})()
    assert is_transient(http_503) and not is_transient(http_404)
    assert not is_transient(FileNotFoundError()) and not is_transient(PermissionError())
    assert not is_transient(tarfile.ReadError("unexpected end of data"))  # damage: counted, not retried
    assert [retry_delay_s(i) for i in range(3)] == pytest.approx([0.1, 0.4, 1.6])


def test_a_failed_open_is_retried_and_counted(tmp_path, flaky, monkeypatch):
    root = make_shards(tmp_path / "s")
    url = read_dataset_info(f"flaky://{root}").shards[3].url  # 40 samples
    clean = [s["__key__"] for s in read_shard(str(root / "shard-000003.tar"), 40, Counter())]
    monkeypatch.setattr(flaky, "fail_opens", 2)
    stats: Counter = Counter()
    assert [s["__key__"] for s in read_shard(url, 40, stats)] == clean
    assert stats["read_retries"] == 2 and not stats["read_failures"] and not stats["truncated_shards"]


def test_a_read_failing_mid_shard_resumes_without_losing_or_repeating_samples(tmp_path, flaky, monkeypatch):
    root = make_shards(tmp_path / "s")
    url = read_dataset_info(f"flaky://{root}").shards[3].url
    clean = [(s["__key__"], s["jpg"]) for s in read_shard(str(root / "shard-000003.tar"), 40, Counter())]
    size = (root / "shard-000003.tar").stat().st_size
    monkeypatch.setattr(flaky, "fail_opens", 1)
    monkeypatch.setattr(flaky, "fail_after_bytes", size // 2)  # the connection breaks half-way, once
    stats: Counter = Counter()
    assert [(s["__key__"], s["jpg"]) for s in read_shard(url, 40, stats)] == clean  # same samples, same order
    assert stats["read_retries"] == 1 and not stats["read_errors"] and not stats["truncated_shards"]


def test_only_a_persistent_failure_counts_the_shard_as_damaged(tmp_path, flaky, monkeypatch):
    root = make_shards(tmp_path / "s")
    url = read_dataset_info(f"flaky://{root}").shards[1].url  # 17 samples
    monkeypatch.setattr(flaky, "fail_opens", 10)
    stats: Counter = Counter()
    assert list(read_shard(url, 17, stats, retries=2)) == []
    assert stats == Counter(read_retries=2, read_failures=1, truncated_shards=1, missing_samples=17)


def test_eval_stream_retries_every_shard_and_reads_every_sample(tmp_path, flaky, monkeypatch):
    root = make_shards(tmp_path / "s")
    monkeypatch.setattr(flaky, "fail_opens", 1)
    stream = EvalStream(f"flaky://{root}", batch_size=16, image_size=16, return_keys=True)
    keys = [k for _, _, batch in stream for k in batch]
    assert sorted(keys) == [f"{k:06d}" for k in range(sum(UNEVEN))]
    assert stream.stats["read_retries"] == len(UNEVEN) and not stream.stats["truncated_shards"]


def test_train_stream_with_loader_workers_retries_and_yields_the_clean_batches(tmp_path, flaky, monkeypatch):
    """Two forked loader workers read every shard through storage whose first two opens of each shard fail: the
    epoch's batches are exactly those of a clean read, and every retry is counted in the stream's stats."""
    root = make_shards(tmp_path / "s")
    kw: dict[str, Any] = dict(
        micro_batch_size=8, image_size=16, num_workers=2, loader_start_method="fork", shuffle_buffer=8
    )
    clean = TrainStream(DataConfig.for_stream(root, **kw))
    expected = [b for _, b in zip(range(clean.steps_per_epoch), clean)]
    monkeypatch.setattr(flaky, "fail_opens", 2)
    flaky_stream = TrainStream(DataConfig.for_stream(f"flaky://{root}", **kw))
    got = [b for _, b in zip(range(flaky_stream.steps_per_epoch), flaky_stream)]
    assert len(got) == len(expected) == clean.steps_per_epoch
    for (x, y), (cx, cy) in zip(got, expected):
        assert torch.equal(x, cx) and torch.equal(y, cy)
    opened = {p.name for p in Path(flaky.state_dir).iterdir()}
    assert flaky_stream.stats["read_retries"] == 2 * len(opened) > 0  # two per shard the epoch read
    assert not flaky_stream.stats["read_failures"] and not flaky_stream.stats["truncated_shards"]


def test_read_retries_is_a_checked_setting(tmp_path):
    with pytest.raises(ValueError, match="read_retries"):
        TrainStream(DataConfig.for_stream(tmp_path, micro_batch_size=8, image_size=16, read_retries=-1))
    # Checked once, when the recipe is loaded: the message says where the value came from.
    with pytest.raises(ValueError, match=r"^--set override: data\.read_retries=-1 must be >= 0"):
        load_config("local_demo", ["data.read_retries=-1"])
    assert load_config("local_demo").data.read_retries == 3


@pytest.fixture
def dropping_s3(monkeypatch):
    """S3 clients (s3fs, as for any ``s3://`` data root) pointed at a 127.0.0.1 port that accepts each connection
    and closes it unanswered, as a load balancer dropping connections does; ``refused`` is a port nothing listens
    on. s3fs and botocore retry once each (their defaults retry the same errors, only slower)."""
    import socket
    import threading

    import s3fs

    server = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    refused = closed.getsockname()[1]
    closed.close()

    def drop() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            connection.recv(65536)
            connection.close()

    threading.Thread(target=drop, daemon=True).start()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", f"http://127.0.0.1:{refused}"
    finally:
        server.close()
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("endpoint", ["dropping", "refused"])
def test_an_s3_connection_closed_or_refused_is_retried_and_counted_not_raised(dropping_s3, monkeypatch, endpoint):
    """botocore's errors for a connection closed before the answer (ConnectionClosedError) or not made
    (EndpointConnectionError) are not OSErrors: a shard read that meets them is retried, and then counted as
    damaged, like any reset connection, rather than ending the run."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", dropping_s3[endpoint == "refused"])
    stats: Counter = Counter()
    assert list(read_shard("s3://bucket/train/shard-000000.tar", 5, stats, retries=1)) == []
    assert stats == Counter(read_retries=1, read_failures=1, truncated_shards=1, missing_samples=5)


@pytest.mark.timeout(120)
def test_a_shard_that_cannot_be_read_for_good_is_one_line_naming_it(tmp_path):
    """A read refused for good (no permission, or a folder where the shard should be: not retried) ended the train
    and eval streams in an OSError traceback; it is now one line naming the shard and the fix."""
    root = make_shards(tmp_path / "s")
    shard = root / "shard-000002.tar"
    shard.unlink()
    shard.mkdir()
    config = DataConfig.for_stream(root, micro_batch_size=8, image_size=16, num_workers=2, streams=2)
    with pytest.raises(ValueError) as raised:
        for _ in TrainStream(config):
            pass
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"shard {shard} cannot be read (IsADirectoryError")
    assert message.endswith("give this process read access to the shard folder's files")
    with pytest.raises(ValueError, match=f"^shard {shard} cannot be read"):
        list(EvalStream(root, batch_size=8, image_size=16))


@pytest.mark.parametrize("scheme", ["s3", "gs", "http"])
def test_a_store_that_refuses_this_process_ends_the_read_in_one_line_naming_the_fix(refusing_store, scheme):
    """A store's 403 (wrong or expired credentials) was, from gcsfs, a plain OSError("Forbidden"): retried, then
    counted as a damaged shard; from fsspec's HTTP store a FileNotFoundError: counted as a missing shard. A job whose
    credentials were wrong lost shard after shard, quietly, until a stream had none. Now it is one line naming the
    fix, with no retry."""
    where = refusing_store if scheme == "http" else f"{scheme}://vitscale-denied"
    url = f"{where}/train/shard-000000.tar"
    stats: Counter = Counter()
    with pytest.raises(ShardFormatError) as raised:
        list(read_shard(url, 5, stats, retries=3))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"shard {url} cannot be read (")
    assert "the store refused this process's credentials, or it has none; " in message and not stats
    if scheme != "http":
        assert ("AWS_ACCESS_KEY_ID" if scheme == "s3" else "GOOGLE_APPLICATION_CREDENTIALS") in message


def test_a_401_is_a_refusal_as_a_403_is():
    """gcsfs raises a 401 as its HttpError, s3fs as an OSError(EIO) from botocore's ClientError (an unknown code):
    the first ended the run in a traceback, the second was retried and counted as damage."""
    import botocore.exceptions
    from gcsfs.retry import HttpError
    from s3fs.errors import translate_boto_error

    gcs = HttpError({"code": 401, "message": "Invalid Credentials"})
    answer = {"Error": {"Code": "401", "Message": "Unauthorized"}, "ResponseMetadata": {"HTTPStatusCode": 401}}
    s3 = translate_boto_error(botocore.exceptions.ClientError(answer, "GetObject"))
    assert type(s3) is OSError
    for error in (gcs, s3):
        assert refused(error) and not is_transient(error)
    s3_503 = translate_boto_error(
        botocore.exceptions.ClientError({**answer, "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
    )
    assert is_transient(s3_503) and not refused(s3_503)


def test_access_refused_mid_shard_ends_the_read_instead_of_dropping_the_rest(tmp_path, flaky, monkeypatch):
    """An S3 session token that expires between two range reads of a shard (AccessDenied: PermissionError) was
    counted as damage in the tar and the rest of the shard dropped, quietly, shard after shard."""
    root = make_shards(tmp_path / "s")
    url = read_dataset_info(f"flaky://{root}").shards[3].url
    monkeypatch.setattr(flaky, "fail_opens", 1)
    monkeypatch.setattr(flaky, "fail_after_bytes", (root / "shard-000003.tar").stat().st_size // 2)
    monkeypatch.setattr(flaky, "mid_read_error", PermissionError(errno.EACCES, "Access Denied (token expired)"))
    stats: Counter = Counter()
    with pytest.raises(ShardFormatError, match=r"^shard .* cannot be read \(PermissionError: .*Access Denied"):
        list(read_shard(url, 40, stats))
    assert not stats["read_errors"] and not stats["truncated_shards"]


def test_failures_far_apart_in_one_shard_each_get_the_whole_retry_budget(tmp_path, flaky, monkeypatch):
    """The retries were a budget per shard, not per failure: a long shard (ImageNet-21k's ~280 MB, read over
    minutes as the stream consumes it) whose read broke more than data.read_retries times, each time further on and
    each mended by one retry, was given up and the rest of it counted as damaged. A retry that got further starts
    the count again; a read that keeps failing at the same place still gives up."""
    root = make_shards(tmp_path / "s")
    url = read_dataset_info(f"flaky://{root}").shards[3].url  # 40 samples
    clean = [s["__key__"] for s in read_shard(str(root / "shard-000003.tar"), 40, Counter())]
    size = (root / "shard-000003.tar").stat().st_size
    monkeypatch.setattr(flaky, "fail_opens", 5)  # 5 breaks, at 1/6, 2/6, ... 5/6 of the shard
    monkeypatch.setattr(flaky, "fail_after_bytes", size // 6)
    monkeypatch.setattr(flaky, "further_each_open", True)
    stats: Counter = Counter()
    assert [s["__key__"] for s in read_shard(url, 40, stats, retries=3)] == clean
    assert stats == Counter(read_retries=5)
    for p in Path(flaky.state_dir).iterdir():
        p.unlink()
    monkeypatch.setattr(flaky, "further_each_open", False)  # 5 breaks at 1/6: the same failure, again and again
    stats = Counter()
    got = [s["__key__"] for s in read_shard(url, 40, stats, retries=3)]
    assert 0 < len(got) < 40 // 5 and got == clean[: len(got)]
    assert stats == Counter(read_retries=3, read_failures=1, truncated_shards=1, missing_samples=40 - len(got))


def test_no_credentials_at_all_is_the_same_one_line(tmp_path, monkeypatch):
    """botocore's NoCredentialsError (a node without keys, or an instance role it could not fetch) is no OSError: it
    ended the train stream in a traceback (a loader worker's, in its message)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: no credentials to sign with
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    url = "s3://vitscale-shards/train/shard-000000.tar"
    stats: Counter = Counter()
    try:
        with pytest.raises(ShardFormatError, match=r"\(NoCredentialsError: .*it has none; set AWS_ACCESS_KEY_ID"):
            list(read_shard(url, 5, stats))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert not stats
