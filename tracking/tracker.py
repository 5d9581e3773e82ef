"""The rank-0 MLflow tracker, and where the run's record is stored.

Training workers, eval tasks and the cluster driver log into one run through a :class:`Tracker` (the run itself
is created by :mod:`tracking.runs`). The contract that matters most: **a tracking failure never stops training.**
A locked SQLite file, an unreachable MLflow server or a full disk makes the tracker warn (rate-limited), keep what
it could not send in a bounded in-memory buffer, and send it on a later call or on :meth:`Tracker.flush`.

``mlflow`` is imported lazily inside functions so that ``import tracking.tracker`` stays cheap (the training loop
and CLI ``--help`` paths import this module).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.paths import PROJECT_ROOT

logger = logging.getLogger(__name__)


# MLflow's own limits (mlflow.utils.validation); a value over the limit makes the whole batch fail, so we
# truncate rather than lose every other param of the run.
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
MAX_PARAMS_TAGS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000

# MLflow error codes that no retry can fix (bad value, deleted run, conflicting param): such a batch is dropped
# with a warning instead of being retried forever.
_PERMANENT_ERROR_CODES = frozenset(
    {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS"}
)


def default_tracking_uri(root: Path | str | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded store ``sqlite:///<root>/mlflow.db``.

    ``root`` defaults to the project folder. A plain ``./mlruns`` file store is never returned: MLflow >= 3.13
    refuses it.
    """
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    base = Path(root) if root is not None else PROJECT_ROOT
    return f"sqlite:///{(base / 'mlflow.db').resolve()}"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or None for any other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri[len("sqlite:///") :])


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Where an embedded store keeps an experiment's artifacts: next to the database, never relative to CWD.

    MLflow's own default for a SQLite store is ``./mlruns`` under whatever the current directory is, so runs
    created from different folders (driver, eval task, test) would scatter their artifacts. Servers decide for
    themselves (None).
    """
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("_") or "experiment"
    return (db.parent / "mlartifacts" / slug).resolve().as_uri()


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested config dict to MLflow params: ``{"optim": {"lr": 1e-3}} -> {"optim.lr": "0.001"}``.

    Lists/tuples become JSON; None becomes ``"None"``; values longer than MLflow's limit (6000 characters) are
    truncated with a marker so the rest of the batch is still accepted. Keys longer than 250 characters raise
    ``ValueError`` (a config that deep is a bug, not something to hide).
    """
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, prefix=f"{name}."))
            continue
        if isinstance(value, (list, tuple)):
            text = json.dumps(list(value), default=str)
        elif isinstance(value, Mapping):
            text = "{}"
        else:
            text = str(value)
        if len(name) > MAX_KEY_LENGTH:
            raise ValueError(f"config key {name!r} is longer than MLflow's {MAX_KEY_LENGTH}-character limit")
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            marker = f"...[truncated, {len(text)} chars]"
            text = text[: MAX_PARAM_VALUE_LENGTH - len(marker)] + marker
        flat[name] = text
    return flat


@dataclass(frozen=True)
class _Artifact:
    local_path: str
    artifact_path: str | None


@dataclass(frozen=True)
class _PendingMetric:
    seq: int  # position in the stream of logged values, to remove exactly what was sent
    key: str
    value: float
    timestamp_ms: int
    step: int


class _QuietMlflowDbErrors(logging.Filter):
    """Drops MLflow's own traceback log for SQL errors while a Tracker is sending from this thread.

    MLflow logs ``logger.exception`` for every failed SQL statement before raising; during an outage that would
    print a traceback per retry. The Tracker already reports the failure once, in one line.
    """

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.active, "sending", False)


_QUIET_FILTER = _QuietMlflowDbErrors()


def _rank_from_env() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class Tracker:
    """Rank-aware MLflow logger that never raises into, and never blocks, the training loop.

    Only rank 0 (``RANK`` env, or ``rank=``) with ``enabled=True`` and a ``run_id`` logs; everywhere else every
    method is a no-op. ``log_*`` calls only append to an in-memory buffer (metrics keep the timestamp and step of
    the call) and wake a background sender thread, so a slow or locked store (SQLite waits up to 20 s on a lock)
    costs the training step nothing. When sending fails the tracker warns (at most once per ``warn_interval_s``),
    keeps the buffer (beyond ``max_buffered`` metric values the oldest are dropped and counted in a warning) and
    retries after an exponential backoff (1 s doubling up to ``max_backoff_s``), or at once on :meth:`flush`.
    A batch MLflow rejects as invalid (e.g. a param re-logged with another value) is dropped with a warning.
    The sender writes at most once per ``send_every_s``, everything buffered in one go: a write per step had the
    sender's Python (SQLAlchemy) take the GIL from the training thread for 5% of rank 0's time in `local_demo`,
    most of it while the thread was loading its batch (docs/performance.md, "The MLflow sender"); :meth:`sync`
    sends at once (before each checkpoint).

    Keys under a prefix given to :meth:`log_once_per_step` keep one value per step in the run: values at steps the
    run already holds (a restarted worker group redoing the steps after its checkpoint) are not sent again.
    """

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
    ) -> None:
        self.rank = _rank_from_env() if rank is None else rank
        self.enabled = bool(enabled and run_id and self.rank == 0)
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.run_id = run_id
        self.max_buffered = max_buffered
        self.warn_interval_s = warn_interval_s
        self.max_backoff_s = max_backoff_s
        self.send_every_s = send_every_s
        # Buffers, guarded by _buffer_lock (held only for list operations, never while talking to MLflow).
        self._metrics: deque[_PendingMetric] = deque()
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._artifacts: list[_Artifact] = []
        self._next_seq = 0
        self._dropped = 0
        # log_once_per_step: key prefixes, and the highest step of each key the run held when we connected.
        self._once_prefixes: tuple[str, ...] = ()
        self._run_steps: dict[str, int] = {}
        self._said_skipping = False
        self._buffer_lock = threading.Lock()
        # Delivery state, guarded by _send_lock (one sender at a time: the thread or a flush()).
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
        self._hurry = threading.Event()  # cuts the sender's coalescing wait short: sync() and close()
        self._attempted = threading.Event()  # set after each of the sender's delivery attempts
        self._thread: threading.Thread | None = None
        if self.enabled:  # addFilter is idempotent; done here, not at import, to keep import side-effect free
            logging.getLogger("mlflow.store.db.utils").addFilter(_QUIET_FILTER)
            _track_for_exit(self)
            # MLflow now, on this thread, not on the sender's first turn: importing it takes seconds on a loaded
            # machine, and a checkpoint soon after the start waits at most sync()'s timeout for the steps before it
            # to be sent. (A training rank imports DeepSpeed without MLflow: pretrain.distributed.import_deepspeed.)
            import mlflow  # noqa: F401

    # ---- public API -------------------------------------------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer ``metrics`` at ``step`` for sending. Non-numeric values are skipped with a warning."""
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
                if len(self._metrics) >= self.max_buffered:
                    self._metrics.popleft()
                    self._dropped += 1
                self._metrics.append(_PendingMetric(self._next_seq, str(key), number, now_ms, int(step)))
                self._next_seq += 1
        self._kick()

    def log_once_per_step(self, *prefixes: str) -> None:
        """Send at most one value per step of each key starting with one of ``prefixes`` to this run.

        MLflow's metric history is append-only, so when a worker group restarts from its newest checkpoint the
        redone steps would be logged a second time (a zig-zag in every plot). On connecting, the tracker reads
        the highest step the run holds for each key (its latest metric, which MLflow keeps at the highest step);
        values at or below it are skipped: the first value logged for a step is the one kept.
        """
        with self._buffer_lock:
            self._once_prefixes = tuple(dict.fromkeys((*self._once_prefixes, *prefixes)))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params; nested dicts are flattened like :func:`flatten_config`."""
        if not self.enabled:
            return
        flat = flatten_config(params)
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
        """Upload a file or folder (in the background): keep it until :meth:`flush` returns True."""
        if not self.enabled:
            return
        with self._buffer_lock:
            self._artifacts.append(_Artifact(str(local_path), artifact_path))
        self._kick()

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything buffered now, ignoring the backoff; True when nothing is left buffered.

        Waits for an attempt the sender thread has in progress (at most ``timeout`` seconds, None = no limit).
        """
        if not self.enabled:
            return True
        if not self._send_lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._attempt()
        finally:
            self._send_lock.release()
        return self.pending == 0

    def sync(self, timeout: float = 5.0) -> bool:
        """Have the sender deliver what is buffered now, not at its next turn, and wait until it has (at most
        ``timeout`` seconds); True when nothing is left buffered. Never raises.

        A checkpoint calls this before it is published (`pretrain.checkpointer.Checkpointer`): the steps up to a
        checkpoint are never trained again, so their metrics must reach the run before a lost worker can take them
        along, buffered. While the store is failing (backing off) it returns False at once: training does not wait
        on a store that is down; the buffer is sent when it recovers, as always.
        """
        if not self.enabled:
            return True
        deadline = time.monotonic() + timeout
        while self.pending:
            if self._failures or time.monotonic() >= deadline:
                return False
            self._attempted.clear()
            self._hurry.set()
            self._kick()
            self._attempted.wait(max(0.0, deadline - time.monotonic()))
        return True

    def close(self, timeout: float | None = 120.0) -> None:
        """Make one last attempt to send everything, stop the sender, and warn about what could not be sent.

        The last attempt runs on the sender thread and ``timeout`` bounds the wait for it, so the end of training
        never hangs on a server that accepts connections but never answers (MLflow's HTTP client waits and
        retries for minutes); None waits as long as it takes.
        """
        if not self.enabled:
            return
        self._closing.set()
        self._hurry.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        if self.pending:
            self._warn(f"closing with {self.pending} items not sent to MLflow run {self.run_id}", force=True)
        self.enabled = False
        _OPEN_TRACKERS.discard(self)

    @property
    def pending(self) -> int:
        """Number of buffered items (metric values + params + tags + artifacts) not yet sent."""
        with self._buffer_lock:
            return len(self._metrics) + len(self._params) + len(self._tags) + len(self._artifacts)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- delivery (sender thread, or flush) -------------------------------------------------------------------

    def _kick(self) -> None:
        if self._thread is None and not self._closing.is_set():
            self._thread = threading.Thread(target=self._run_sender, name="vitscale-mlflow", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run_sender(self) -> None:
        while not self._closing.is_set():
            wait = max(0.0, self._next_attempt - time.monotonic())
            self._wake.wait(timeout=wait if self._failures else None)
            self._wake.clear()
            self._hurry.wait(self._last_send + self.send_every_s - time.monotonic())  # what else comes meanwhile
            self._hurry.clear()
            if self._closing.is_set() or time.monotonic() < self._next_attempt or self.pending == 0:
                self._attempted.set()
                continue
            with self._send_lock:
                self._attempt()
                self._last_send = time.monotonic()
            self._attempted.set()
        with self._send_lock:  # close(): one last attempt regardless of the backoff
            self._attempt()

    def _attempt(self) -> None:
        """One delivery attempt of everything buffered; the caller holds _send_lock. Never raises."""
        if self.pending == 0:
            return
        _QUIET_FILTER.active.sending = True
        try:
            self._send_all()
        except Exception as error:  # noqa: BLE001 — any failure of the store must stay out of training
            self._failures += 1
            backoff = min(self.max_backoff_s, 2.0 ** (self._failures - 1))
            self._next_attempt = time.monotonic() + backoff
            summary = " ".join(str(error).split())[:240]
            self._warn(
                f"MLflow tracking to {self.tracking_uri} failed ({type(error).__name__}: {summary}); "
                f"{self.pending} items buffered, retrying in {backoff:.0f}s. Training continues."
            )
        else:
            if self._failures:
                self._warn(f"MLflow tracking recovered after {self._failures} failed attempt(s)", force=True)
            self._failures = 0
            self._next_attempt = 0.0
        finally:
            _QUIET_FILTER.active.sending = False

    def _send_all(self) -> None:
        from mlflow.entities import Metric, Param, RunTag  # heavy (seconds to import): only when a run is touched

        client = self._get_client()
        # Params and tags first: a run whose metrics arrived without its config is hard to interpret.
        for store, make, what in ((self._params, Param, "params"), (self._tags, RunTag, "tags")):
            while True:
                with self._buffer_lock:
                    batch = dict(list(store.items())[:MAX_PARAMS_TAGS_PER_BATCH])
                if not batch:
                    break
                entities = [make(k, v) for k, v in batch.items()]
                self._send_batch(what, lambda e=entities, w=what: client.log_batch(self.run_id, **{w: e}))
                with self._buffer_lock:
                    for key, value in batch.items():
                        if store.get(key) == value:  # a newer value logged meanwhile stays queued
                            del store[key]
        while True:
            with self._buffer_lock:
                metrics = list(itertools.islice(self._metrics, _MAX_METRICS_PER_BATCH))
            if not metrics:
                break
            sent = [Metric(m.key, m.value, m.timestamp_ms, m.step) for m in metrics if not self._already_logged(m)]
            if sent:
                self._send_batch("metrics", lambda e=sent: client.log_batch(self.run_id, metrics=e))
            with self._buffer_lock:
                # Sequence numbers, not counts: log_metrics may have dropped the oldest values meanwhile.
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
                self._artifacts.remove(item)
        with self._buffer_lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            self._warn(f"{dropped} metric values were dropped while MLflow was unreachable (buffer full)", force=True)

    def _send_batch(self, what: str, send) -> None:
        """Run ``send``; swallow permanent MLflow rejections (warn), re-raise everything else for a retry."""
        from mlflow.exceptions import MlflowException  # heavy (seconds to import): only when a run is touched

        try:
            send()
        except MlflowException as error:
            if error.error_code not in _PERMANENT_ERROR_CODES:
                raise
            self._warn(
                f"MLflow rejected {what} for run {self.run_id} ({error.error_code}): {error.message}; dropped",
                force=True,
            )

    def _upload(self, client, item: _Artifact) -> None:
        if Path(item.local_path).is_dir():
            client.log_artifacts(self.run_id, item.local_path, item.artifact_path)
        else:
            client.log_artifact(self.run_id, item.local_path, item.artifact_path)

    def _get_client(self):
        if self._client is None:
            from mlflow import MlflowClient  # heavy (seconds to import): only when a run is touched

            client = MlflowClient(tracking_uri=self.tracking_uri)
            # Touch the store now so an unreachable one fails here, inside the retry logic. This happens before
            # anything of ours is sent, so the steps read are those of earlier processes (log_once_per_step).
            run = client.get_run(self.run_id)
            self._run_steps = {m.key: m.step for m in run.data.to_proto().metrics}
            self._client = client
        return self._client

    def _already_logged(self, metric: _PendingMetric) -> bool:
        """True for a value of a log_once_per_step key at a step the run held before this tracker connected."""
        if not metric.key.startswith(self._once_prefixes) or metric.step > self._run_steps.get(metric.key, -1):
            return False
        if not self._said_skipping:
            self._said_skipping = True
            logger.info(
                f"MLflow run {self.run_id} already holds {metric.key} up to step {self._run_steps[metric.key]}: "
                "the redone steps are not logged again (training resumed from an earlier checkpoint)"
            )
        return True

    def _warn(self, message: str, force: bool = False) -> None:
        """Log a warning; unforced ones (the outage notice) at most once per warn_interval_s."""
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


# Trackers still open at interpreter exit get one last flush (bounded), so a forgotten close() loses nothing
# when the store is up. The exit hook is registered with the first enabled Tracker, not at import.
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
