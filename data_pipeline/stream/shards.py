"""Reading one shard (`read_shard`; docs/elastic.md, "Faults"; docs/reference.md §6, "Errors")."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

import fsspec
from webdataset import tariterators

from data_pipeline.manifest import ShardFormatError
from data_pipeline.paths import is_remote
from data_pipeline.write.readers import is_safe_member

log = logging.getLogger(__name__)

WANTED_SUFFIXES = ("jpg", "cls")
_last_warning = [0.0]
RETRY_FIRST_S, RETRY_FACTOR = 0.1, 4.0
_retries = [3]  # this process's data.read_retries
# Remote-store client errors for a connection broken mid-answer, or not made (botocore's are not OSErrors)
_TRANSIENT_NAMES = frozenset(
    (
        "ClientPayloadError",
        "ConnectionClosedError",
        "EndpointConnectionError",
        "ServerDisconnectedError",
        "ProtocolError",
        "IncompleteRead",
        "ChunkedEncodingError",
        "ResponseStreamingError",
        "ReadTimeoutError",
    )
)
# A store's refusal, or no credentials to show it (botocore's, google-auth's after gcsfs's retries): the fix is the
# credentials of every process that reads, not a retry
_NO_CREDENTIALS = frozenset(
    ("NoCredentialsError", "PartialCredentialsError", "RefreshError", "DefaultCredentialsError")
)
CREDENTIALS = {  # the fix for a process that a store refuses, by scheme (data_pipeline.validate's too)
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, which expires)",
    "gs": "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS",
}


def _warn(message: str) -> None:
    """At most one warning per 10 s per process: a damaged shard must not flood the log."""
    now = time.monotonic()
    if now - _last_warning[0] > 10.0:
        _last_warning[0] = now
        log.warning(message)


def set_read_retries(retries: int) -> None:
    """This process's ``data.read_retries`` (each loader worker sets its own)."""
    if retries < 0:
        raise ValueError(f"read retries must be >= 0, got {retries}")
    _retries[0] = retries


def retry_delay_s(attempt: int) -> float:
    return RETRY_FIRST_S * RETRY_FACTOR**attempt


def _status(error: BaseException) -> int | None:
    """The HTTP status a store client's error carries (aiohttp, gcsfs, requests, botocore), if any."""
    status = getattr(error, "status", None) or getattr(error, "code", None)
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        status = status or response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    status = status or getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _refusal(error: BaseException) -> BaseException | None:
    """``error``, or the error it was raised from, that refuses this process access: a PermissionError, HTTP 401 or
    403 (s3fs raises an unknown code's as an OSError, fsspec's HTTP store a FileNotFoundError, gcsfs a 403 as a plain
    ``OSError("Forbidden: ...")``), no credentials; None if none does."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, PermissionError) or _status(cause) in (401, 403):
            return cause
        if type(cause).__name__ in _NO_CREDENTIALS:
            return cause
        if type(cause) is OSError and str(cause).startswith("Forbidden"):
            return cause
        cause = cause.__cause__
    return None


def refused(error: BaseException) -> bool:
    return _refusal(error) is not None


def is_transient(error: BaseException) -> bool:
    """Whether a read error is worth retrying: an OSError but a missing file or no permission, HTTP 5xx/408/429."""
    if refused(error) or isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(error, OSError):
        return True
    status = _status(error)
    if isinstance(status, int) and (500 <= status < 600 or status in (408, 429)):
        return True
    return type(error).__name__ in _TRANSIENT_NAMES


def _unreadable(url: str, error: BaseException) -> ShardFormatError:
    """One line naming the shard and the fix for a read that no retry mends."""
    refusal = _refusal(error) or error
    reason = f"{type(refusal).__name__}: {' '.join(str(refusal).split())}"
    if is_remote(url) and refused(error):
        fix = CREDENTIALS.get(url.split("://")[0], "give credentials that can read the shard folder") + " on every node"
        return ShardFormatError(
            f"shard {url} cannot be read ({reason}): the store refused this process's credentials, or it has none; "
            f"{fix}"
        )
    return ShardFormatError(
        f"shard {url} cannot be read ({reason}); give this process read access to the shard folder's files"
    )


def read_shard(url: str, expected: int | None, stats: Counter, retries: int | None = None) -> Iterator[dict]:
    """Samples (``__key__``, ``jpg``, ``cls`` bytes) of the shard at ``url``; transient failures retried
    ``retries`` times (None: `set_read_retries`'s), damage and a shard short of ``expected`` counted in ``stats``."""
    retries = _retries[0] if retries is None else retries
    count, failures, got_to = 0, 0, 0  # got_to: samples delivered when the last failure came
    counted: Counter = Counter()  # damage counted so far: a retry re-reads the shard from its start
    while True:
        try:
            for index, sample in enumerate(_tar_samples(url, _DamageCount(stats, counted))):
                if index < count:
                    continue
                count += 1
                yield sample
            break
        except Exception as err:
            if isinstance(err, FileNotFoundError) and not refused(err):
                stats["missing_shards"] += 1
                _warn(f"shard {url} is missing: {err}")
                break
            if refused(err) or (isinstance(err, OSError) and not is_transient(err)):  # not the data's: no retry mends
                raise _unreadable(url, err) from err
            if not is_transient(err):
                raise
            if count > got_to:  # this read got further than the last: a new failure, with the whole budget
                failures, got_to = 0, count
            if failures >= retries:
                stats["read_failures"] += 1
                _warn(f"shard {url}: read failed {failures + 1} times ({err!r}); counting the rest of it as damaged")
                break
            stats["read_retries"] += 1
            _warn(f"shard {url}: read failed ({err!r}); trying again in {retry_delay_s(failures):g} s")
            time.sleep(retry_delay_s(failures))
            failures += 1
    if expected is not None and count < expected:
        stats["truncated_shards"] += 1
        stats["missing_samples"] += expected - count
        _warn(f"shard {url} yielded {count} of the {expected} samples its manifest lists (truncated or damaged)")


class _DamageCount:
    """One read's damage, counted in ``stats`` past what an earlier read of the same shard (``counted``) met."""

    def __init__(self, stats: Counter, counted: Counter):
        self.stats, self.counted = stats, counted
        self.seen: Counter = Counter()

    def __call__(self, name: str) -> None:
        self.seen[name] += 1
        if self.seen[name] > self.counted[name]:
            self.counted[name] += 1
            self.stats[name] += 1


def _tar_samples(url: str, damage: _DamageCount) -> Iterator[dict]:
    def handler(exn: Exception) -> bool:
        if is_transient(exn) or refused(exn):
            raise exn
        damage("read_errors")
        _warn(f"error reading shard {url}: {exn!r}; continuing without it")
        return True

    def select(name: str) -> bool:
        if not is_safe_member(name):
            damage("unsafe_members")
            _warn(f"shard {url}: skipped tar member with unsafe name {name!r}")
            return False
        return name.rsplit(".", 1)[-1].lower() in WANTED_SUFFIXES

    with fsspec.open(url, "rb") as stream:
        files = tariterators.tar_file_expander(
            [{"url": url, "stream": stream}], handler=handler, select_files=select, eof_value=None
        )
        yield from tariterators.group_by_keys(files, handler=handler)


def sample_label(sample: dict, num_classes: int, stats: Counter) -> int | None:
    """A sample's label, or None (counted in ``stats``) for a missing member or an invalid label."""
    if "jpg" not in sample or "cls" not in sample:
        stats["incomplete_samples"] += 1
        return None
    try:
        label = int(sample["cls"])
    except ValueError:
        stats["bad_labels"] += 1
        return None
    if not 0 <= label < num_classes:
        stats["label_out_of_range"] += 1
        return None
    return label
