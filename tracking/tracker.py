"""The rank-0 MLflow `Tracker`, which never stops training (docs/design.md, "Tracking at a job's start"). ``mlflow``
is imported inside functions: the training loop and CLI ``--help`` import this module."""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.paths import write_text_atomically
from tracking import store
from tracking.store import (
    DELIVER_COMMAND,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    PENDING_RUN,
    PERMANENT_ERROR_CODES,
    default_tracking_uri,
    flatten_config,
    read_run_record,
    recorded_run_id,
    refused_name,
    spool_copies,
    spool_dir,
    unanswered,
    unserved,
)

logger = logging.getLogger(__name__)


PENDING_POLL_S = 2.0  # how often a Tracker of a pending run reads the record
CLOSE_RETRIES = 3  # close()'s last send, when it fails, is tried again this often (1, 2, 4 s apart)
# A Tracker of a run still pending at close waits this long for it, then leaves its records in the spool, beside the
# run record, for the job's end or its courier to send (docs/design.md, "Tracking at a job's start").
PENDING_CLOSE_S = 3.0
# A Tracker closing while a call to its URI has failed in this process and no send has succeeded since, or while its
# server does not answer or fails a request for the run, waits this long at most: MLflow's own retries of such a
# server last minutes, and a job's end closes several.
UNANSWERED_CLOSE_S = 10.0


@dataclass(frozen=True)
class _Artifact:
    local_path: str
    artifact_path: str | None


@dataclass(frozen=True)
class _PendingMetric:
    seq: int  # removes exactly what was sent
    key: str
    value: float
    timestamp_ms: int
    step: int


_SENDING = threading.local()  # `sending` is True while a Tracker sends from this thread (it warns itself):


def _quiet_while_sending(record: logging.LogRecord) -> bool:
    """The filter that drops MLflow's per-retry SQL tracebacks meanwhile."""
    return not getattr(_SENDING, "sending", False)


def _rank_from_env() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class Tracker:
    """MLflow logger that never raises into, nor blocks, the training loop; only rank 0 (``RANK`` or ``rank=``) with a
    ``run_id`` logs. A sender thread writes the buffer at most once per ``send_every_s`` (docs/performance.md, "The
    MLflow sender"); a failed send warns (rate limited), keeps up to ``max_buffered`` metrics and retries, backing off
    to ``max_backoff_s``. A pending ``run_id`` is resolved from its record; a logged value equal to it is sent as the
    run's id. What close() cannot send waits in the spool of the run's record (a pending run's, or ``record`` where it
    names the run) for `tracking.runs.send_spooled`; ``spool=False`` (a spool file's sender) keeps it buffered."""

    def __init__(
        self,
        tracking_uri: str | None,
        run_id: str | None,
        enabled: bool = True,
        *,
        rank: int | None = None,
        max_buffered: int = 100_000,
        warn_interval_s: float = 60.0,
        max_backoff_s: float = 60.0,
        send_every_s: float = 1.0,
        record: Path | str | None = None,
        spool: bool = True,
    ) -> None:
        self.rank = _rank_from_env() if rank is None else rank
        self.enabled = bool(enabled and run_id and self.rank == 0)
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.run_id = run_id
        self._placeholder = run_id if run_id and run_id.startswith(PENDING_RUN) else None  # until run_id is real
        self._record = self._placeholder[len(PENDING_RUN) :] if self._placeholder else record
        self._may_spool = spool
        self.max_buffered = max_buffered
        self.warn_interval_s = warn_interval_s
        self.max_backoff_s = max_backoff_s
        self.send_every_s = send_every_s
        # Guarded by _buffer_lock, never held while talking to MLflow.
        self._metrics: deque[_PendingMetric] = deque()
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._artifacts: list[_Artifact] = []
        self._next_seq = 0
        self._dropped = 0
        self._once_prefixes: tuple[str, ...] = ()
        self._run_steps: dict[str, range | set[int]] = {}  # the steps of once-per-step keys the run held
        self._exact_steps = False  # a spool's records: look each step up, they may come after later steps
        self._said_skipping = False
        self._said_infinite: set[str] = set()  # keys logged +-inf, warned about once
        self._names: dict[str, bool] = {}  # name -> whether MLflow takes it (`_takes`)
        self._rejections: set[str] = set()  # `_send_batch`'s warnings, each given once
        self._said_pending = False
        self._buffer_lock = threading.Lock()
        # Guarded by _send_lock: one sender at a time (the thread or flush()).
        self._send_lock = threading.Lock()
        self._failures = 0
        self._next_attempt = 0.0
        self._last_send = -math.inf
        self._client = None
        self._warn_lock = threading.Lock()
        self._last_warning = -math.inf
        self._suppressed_warnings = 0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._hurry = threading.Event()  # sync(), close(): skip the coalescing wait
        self._attempted = threading.Event()  # set after each send attempt
        self._thread: threading.Thread | None = None
        self._close_by = math.inf  # close()'s deadline for a pending run
        if self.enabled:  # not at import: importing has no side effects
            logging.getLogger("mlflow.store.db.utils").addFilter(_quiet_while_sending)
            _track_for_exit(self)
            # Now, not in the sender: a slow import there would time out an early checkpoint's sync().
            import mlflow  # noqa: F401

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer ``metrics`` at ``step``; a non-numeric value is skipped with a warning. +-inf is logged as NaN, with
        one warning per key: MLflow's SQL stores keep it as +-1.8e308, a finite number to every reader."""
        if not self.enabled:
            return
        now_ms = int(time.time() * 1000)
        with self._buffer_lock:
            for key, value in metrics.items():
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    self._warn(f"metric {key!r} has non-numeric value {value!r}; skipped", force=True)
                    continue
                if math.isinf(number):
                    if key not in self._said_infinite:
                        self._said_infinite.add(key)
                        self._warn(f"metric {key!r} is {number} at step {step}: logged as NaN", force=True)
                    number = math.nan
                if len(self._metrics) >= self.max_buffered:
                    self._metrics.popleft()
                    self._dropped += 1
                self._metrics.append(_PendingMetric(self._next_seq, str(key), number, now_ms, int(step)))
                self._next_seq += 1
        self._kick()

    def log_once_per_step(self, *prefixes: str) -> None:
        """Skip keys under ``prefixes`` at steps the run held when we connected (a restart redoes steps)."""
        with self._buffer_lock:
            self._once_prefixes = tuple(dict.fromkeys((*self._once_prefixes, *prefixes)))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Flattened like `flatten_config`; a key MLflow refuses (e.g. too long) is skipped with a warning."""
        if not self.enabled:
            return
        flat = flatten_config(params, long_keys=True)
        with self._buffer_lock:
            self._params.update(flat)
        self._kick()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        with self._buffer_lock:
            self._tags.update({str(k): str(v) for k, v in tags.items()})
        self._kick()

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or folder in the background; keep it on disk until `flush` returns True."""
        if not self.enabled:
            return
        with self._buffer_lock:
            self._artifacts.append(_Artifact(str(local_path), artifact_path))
        self._kick()

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything now, ignoring the backoff; True when nothing is left."""
        if not self.enabled:
            return True
        if not self._send_lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._attempt(look=True)
        finally:
            self._send_lock.release()
        return self.pending == 0

    def connect_in_background(self) -> None:
        """Open the MLflow client on a thread now (up to tens of seconds), so the first send does not pay for it."""
        if self.enabled:
            threading.Thread(target=self._connect_quietly, name="vitscale-mlflow-connect", daemon=True).start()

    def _connect_quietly(self) -> None:
        with self._send_lock:
            _SENDING.sending = True
            try:
                if self._run_exists():
                    self._get_client()
            except Exception:  # noqa: BLE001 — the first send retries and warns
                pass
            finally:
                _SENDING.sending = False

    def sync(self, timeout: float = 5.0) -> bool:
        """Have the sender deliver now (before a checkpoint is published); True when nothing is left, False at once
        while the store is failing."""
        if not self.enabled:
            return True
        deadline = time.monotonic() + timeout
        while self.pending:
            if self._next_attempt or time.monotonic() >= deadline:  # failing, or the run does not exist yet
                return False
            self._attempted.clear()
            self._hurry.set()
            self._kick()
            self._attempted.wait(max(0.0, deadline - time.monotonic()))
        return True

    def close(self, timeout: float | None = 120.0) -> None:
        """One last send, then stop the sender; ``timeout`` bounds the wait."""
        if not self.enabled:
            return
        wait = 120.0 if timeout is None else timeout  # bounded: a pending run's server may never come back
        failing_since = store.FAILING_SINCE.get(self.tracking_uri)
        if self.run_id == self._placeholder:  # its records go to the spool rather than wait for the run
            wait = min(wait, PENDING_CLOSE_S)
        elif failing_since is not None:  # a send in flight may be MLflow retrying for minutes: not waited out
            wait = min(wait, UNANSWERED_CLOSE_S)
        self._close_by = time.monotonic() + wait
        self._closing.set()
        self._hurry.set()
        self._wake.set()
        limit = wait if failing_since is not None else math.inf if timeout is None else timeout
        down, first = "", min(limit, UNANSWERED_CLOSE_S)
        if self._thread is not None:
            self._thread.join(first)
            if self._thread.is_alive() and limit > first and not (down := unserved(self.tracking_uri, self.run_id)):
                self._thread.join(None if limit == math.inf else limit - first)
        with self._buffer_lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:  # else only a send that succeeds says so
            self._warn(f"{dropped} metric values were dropped while MLflow was unreachable (buffer full)", force=True)
        if self.pending:
            why = down and f"{down}: "
            if failing_since is not None:
                why = f"MLflow has failed for {time.monotonic() - failing_since:.0f} s: "
            named = self._record is not None and recorded_run_id(self._record, self.tracking_uri) == self.run_id
            if self._may_spool and (self.run_id == self._placeholder or named):
                self._spool(why)
            else:
                self._warn(f"{why}closing with {self.pending} items not sent to MLflow run {self.run_id}", force=True)
        self.enabled = False
        _OPEN_TRACKERS.discard(self)

    @property
    def pending(self) -> int:
        with self._buffer_lock:
            return len(self._metrics) + len(self._params) + len(self._tags) + len(self._artifacts)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spool(self, why: str) -> None:
        """Move what is buffered to a file of the record's `spool_dir`: for a run not created yet, or not answering."""
        with self._buffer_lock:
            payload = {
                "tracking_uri": self.tracking_uri,
                "ref": self.run_id,
                "once_prefixes": list(self._once_prefixes),
                "params": {k: self._named(v) for k, v in self._params.items()},  # a resolved pending run: its id
                "tags": {k: self._named(v) for k, v in self._tags.items()},
                "metrics": [[m.key, m.value, m.timestamp_ms, m.step] for m in self._metrics],
                "artifacts": [[a.local_path, a.artifact_path] for a in self._artifacts],
            }
            count = len(self._metrics) + len(self._params) + len(self._tags) + len(self._artifacts)
        folder = spool_dir(self._record)
        path = folder / f"{time.time_ns():020d}-{os.getpid()}-{id(self):x}.json"
        try:
            payload["artifacts"] = spool_copies(path, payload["artifacts"])
            for last in (False, True):
                folder.mkdir(parents=True, exist_ok=True)
                try:
                    write_text_atomically(path, json.dumps(payload))
                    break
                except FileNotFoundError:  # send_spooled removed the emptied folder between the two lines
                    if last:
                        raise
        except OSError as error:
            self._warn(f"closing with {count} items not sent to MLflow and not spooled ({error})", force=True)
            return
        with self._buffer_lock:
            for queued in (self._metrics, self._params, self._tags, self._artifacts):
                queued.clear()
        if self.run_id != self._placeholder:
            sends = f"`{DELIVER_COMMAND} {Path(self._record).parent}`, or the run folder's next job end, sends"
            logger.warning(
                f"{why}MLflow run {self.run_id}'s {count} items from this process wait in {path}: {sends} them"
            )
            return
        how = "refuses the job's credentials" if self._refused() else "has not answered"
        logger.warning(f"MLflow {how}; the run's {count} items from this process wait in {path} until it exists")

    def restore(self, payload: Mapping[str, Any]) -> int:
        """Buffer a spool file's records again, with their own times and steps; returns how many."""
        with self._buffer_lock:
            self._once_prefixes = tuple(payload["once_prefixes"])
            self._params.update(payload["params"])
            self._tags.update(payload["tags"])
            for key, value, timestamp_ms, step in payload["metrics"]:
                self._metrics.append(_PendingMetric(self._next_seq, key, float(value), int(timestamp_ms), int(step)))
                self._next_seq += 1
            self._artifacts += [_Artifact(path, artifact_path) for path, artifact_path in payload["artifacts"]]
            self._exact_steps = True
        self._kick()
        return len(payload["metrics"]) + len(payload["params"]) + len(payload["tags"]) + len(payload["artifacts"])

    # ---- delivery (sender thread, or flush)

    def _kick(self) -> None:
        if self._thread is None and not self._closing.is_set():
            self._thread = threading.Thread(target=self._run_sender, name="vitscale-mlflow", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run_sender(self) -> None:
        while not self._closing.is_set():
            wait = max(0.0, self._next_attempt - time.monotonic())
            self._wake.wait(timeout=wait if self._next_attempt else None)
            self._wake.clear()
            self._hurry.wait(self._last_send + self.send_every_s - time.monotonic())  # coalesce
            self._hurry.clear()
            if self._closing.is_set() or time.monotonic() < self._next_attempt or self.pending == 0:
                self._attempted.set()
                continue
            with self._send_lock:
                self._attempt()
                self._last_send = time.monotonic()
            self._attempted.set()
        self._await_run(self._close_by - 1.0)  # a pending run may be created while close() waits
        self._last_sends()

    def _last_sends(self) -> None:
        """close()'s last send, regardless of the backoff, tried again `CLOSE_RETRIES` times within its deadline when
        it fails: a run created as training ends gets its first send then, which can race the driver's params."""
        for retry in range(CLOSE_RETRIES + 1):
            with self._send_lock:
                self._attempt()
            wait = 2.0**retry
            if not self.pending or not self._failures or self.run_id == self._placeholder:
                return
            if retry == CLOSE_RETRIES or time.monotonic() + wait > self._close_by - 1.0:
                return
            time.sleep(wait)

    def _await_run(self, deadline: float) -> None:
        """Until ``deadline``, wait for a pending run's record to name the run (or a refusal)."""
        while self.pending:
            with self._send_lock:
                if self._run_exists() or self._refused():
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(PENDING_POLL_S, left))

    def _attempt(self, look: bool = False) -> None:
        """Send everything buffered; the caller holds _send_lock. Never raises. ``look`` (a caller that waits), or a
        failed send to the URI: first ask whether the server answers (`unanswered`), not MLflow, whose retries of a
        server that is down last minutes."""
        if self.pending == 0:
            return
        if not self._run_exists():  # not a failure: no warning, no backoff
            self._next_attempt = time.monotonic() + PENDING_POLL_S
            return
        _SENDING.sending = True
        try:
            if (look or self.tracking_uri in store.FAILING_SINCE) and (silent := unanswered(self.tracking_uri)):
                raise ConnectionError(silent)
            self._send_all()
        except Exception as error:  # noqa: BLE001 — any failure of the store must stay out of training
            store.mark_failing(self.tracking_uri)
            self._failures += 1
            backoff = min(self.max_backoff_s, 2.0 ** (self._failures - 1))
            self._next_attempt = time.monotonic() + backoff
            summary = " ".join(str(error).split())[:240]
            self._warn(
                f"MLflow tracking to {self.tracking_uri} failed ({type(error).__name__}: {summary}); "
                f"{self.pending} items buffered, retrying in {backoff:.0f}s; the work goes on meanwhile."
            )
        else:
            store.FAILING_SINCE.pop(self.tracking_uri, None)
            if self._failures:
                self._warn(f"MLflow tracking recovered after {self._failures} failed attempt(s)", force=True)
            self._failures = 0
            self._next_attempt = 0.0
        finally:
            _SENDING.sending = False

    def _send_all(self) -> None:
        from mlflow.entities import Metric, Param, RunTag  # heavy

        client = self._get_client()
        # Params and tags first: metrics need their config.
        for queued, make, what in ((self._params, Param, "params"), (self._tags, RunTag, "tags")):
            while True:
                with self._buffer_lock:
                    batch = dict(list(queued.items())[:MAX_PARAMS_TAGS_PER_BATCH])
                if not batch:
                    break
                entities = [make(k, self._named(v)) for k, v in batch.items() if self._takes(k, what)]
                self._log_batch(client, what, entities)
                with self._buffer_lock:
                    for key, value in batch.items():
                        if queued.get(key) == value:  # a newer value logged meanwhile stays queued
                            del queued[key]
        while True:
            with self._buffer_lock:
                metrics = list(itertools.islice(self._metrics, MAX_METRICS_PER_BATCH))
            if not metrics:
                break
            sent = [
                Metric(m.key, m.value, m.timestamp_ms, m.step)
                for m in metrics
                if self._takes(m.key, "metrics") and not self._already_logged(m)
            ]
            self._log_batch(client, "metrics", sent)
            with self._buffer_lock:
                # By seq: log_metrics may have dropped the oldest meanwhile.
                while self._metrics and self._metrics[0].seq <= metrics[-1].seq:
                    self._metrics.popleft()
        while True:
            with self._buffer_lock:
                item = self._artifacts[0] if self._artifacts else None
            if item is None:
                break
            if Path(item.local_path).exists():
                self._send_batch("artifact", lambda a=item: self._upload(client, a))
            else:
                self._warn(f"artifact {item.local_path} no longer exists; not uploaded", force=True)
            with self._buffer_lock:
                if item in self._artifacts:  # else close() spooled it during the upload
                    self._artifacts.remove(item)
        with self._buffer_lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            self._warn(f"{dropped} metric values were dropped while MLflow was unreachable (buffer full)", force=True)

    def _log_batch(self, client, what: str, entities: list) -> None:
        """One changed param fails its whole batch (MLflow's params are immutable): such a batch goes again one param
        at a time, so the others arrive and the changed one is dropped with its warning."""
        sent = not entities or self._send_batch(what, lambda: client.log_batch(self.run_id, **{what: entities}))
        for one in entities if not sent and what == "params" and len(entities) > 1 else []:
            self._send_batch(what, lambda e=[one]: client.log_batch(self.run_id, params=e))

    def _send_batch(self, what: str, send) -> bool:
        """Run ``send``; a permanent rejection warns (False), the rest re-raise for a retry."""
        from mlflow.exceptions import MlflowException  # heavy

        try:
            send()
            return True
        except MlflowException as error:
            if error.error_code not in PERMANENT_ERROR_CODES:
                raise
            message = f"MLflow rejected {what} for run {self.run_id} ({error.error_code}): {error.message}; dropped"
            if message not in self._rejections:  # a run deleted while training refuses every send alike
                self._rejections.add(message)
                self._warn(f"{message} (the same rejection again: without a warning)", force=True)
            return False

    def _takes(self, name: str, what: str) -> bool:
        """Whether MLflow takes ``name``: one it refuses fails the whole batch, so it is skipped, with one warning."""
        if name not in self._names:
            why = refused_name(name)
            self._names[name] = not why
            if why:
                self._warn(f"MLflow refuses {what} named {name!r} ({why}); not sent", force=True)
        return self._names[name]

    def _run_exists(self) -> bool:
        """True for a run id; for a pending run, once its record names the run (then ``run_id``)."""
        if self._placeholder is None or self.run_id != self._placeholder:
            return True
        run_id = recorded_run_id(self._record, self.tracking_uri)
        if run_id is None:
            if not self._said_pending:
                self._said_pending = True
                logger.info(f"MLflow run not created yet ({self.tracking_uri}): its records stay buffered until then")
            return False
        logger.info(f"MLflow run {run_id} exists now: sending the {self.pending} items buffered for it")
        self.run_id = run_id
        return True

    def _refused(self) -> bool:
        return bool(read_run_record(self._record, self.tracking_uri).get("refused"))

    def _named(self, value: str) -> str:
        """The pending reference replaced by the run's id."""
        return self.run_id if self._placeholder is not None and value == self._placeholder else value

    def _upload(self, client, item: _Artifact) -> None:
        if Path(item.local_path).is_dir():
            client.log_artifacts(self.run_id, item.local_path, item.artifact_path)
        else:
            client.log_artifact(self.run_id, item.local_path, item.artifact_path)

    def _get_client(self):
        if self._client is None:
            from mlflow import MlflowClient  # heavy

            client = MlflowClient(tracking_uri=self.tracking_uri)
            # Inside the retries; nothing is sent yet, so these steps are earlier processes'.
            run = client.get_run(self.run_id)
            self._run_steps = {m.key: range(m.step + 1) for m in run.data.to_proto().metrics}
            if self._exact_steps:
                with self._buffer_lock:
                    once = {m.key for m in self._metrics if m.key.startswith(self._once_prefixes)}
                for key in once & set(self._run_steps):
                    self._run_steps[key] = {m.step for m in client.get_metric_history(self.run_id, key)}
            self._client = client
        return self._client

    def _already_logged(self, metric: _PendingMetric) -> bool:
        """True for a log_once_per_step value at a step the run already held."""
        if not metric.key.startswith(self._once_prefixes) or metric.step not in self._run_steps.get(metric.key, ()):
            return False
        if not self._said_skipping:
            self._said_skipping = True
            logger.info(
                f"MLflow run {self.run_id} already holds {metric.key} up to step {max(self._run_steps[metric.key])}: "
                "the redone steps are not logged again (training resumed from an earlier checkpoint)"
            )
        return True

    def _warn(self, message: str, force: bool = False) -> None:
        """Unforced warnings at most once per warn_interval_s."""
        with self._warn_lock:
            now = time.monotonic()
            if not force and now - self._last_warning < self.warn_interval_s:
                self._suppressed_warnings += 1
                return
            if not force:
                self._last_warning = now
                if self._suppressed_warnings:
                    message += f" ({self._suppressed_warnings} similar warnings suppressed)"
                    self._suppressed_warnings = 0
        logger.warning(message)


# Trackers still open at exit get a bounded close().
_OPEN_TRACKERS: weakref.WeakSet[Tracker] = weakref.WeakSet()
_exit_hook_registered = False


def _track_for_exit(tracker: Tracker) -> None:
    global _exit_hook_registered
    if not _OPEN_TRACKERS and not _exit_hook_registered:
        atexit.register(_close_open_trackers)
        _exit_hook_registered = True
    _OPEN_TRACKERS.add(tracker)


def _close_open_trackers() -> None:
    for tracker in list(_OPEN_TRACKERS):
        tracker.close(timeout=30.0)
