"""A run's life in MLflow: creation (once per pre-training job), tags, final status, the credentials a job takes.
`create_run` and `open_job_run` raise; `start_job_run` and `finish_run` never do (docs/design.md, "Tracking at a job's
start")."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from data_pipeline.paths import PROJECT_ROOT, write_text_atomically
from tracking import keys
from tracking.store import (
    MAX_PARAMS_TAGS_PER_BATCH,
    PENDING_RUN,
    default_artifact_location,
    default_tracking_uri,
    flatten_config,
    missing_run,
    pending_run_ref,
    recorded_run_id,
    spool_copies_dir,
    spool_dir,
    unanswered,
)
from tracking.tracker import Tracker

RUN_RECORD = "mlflow_run.json"  # in the run folder: the MLflow run a relaunch continues
CREATION_LOCK = "mlflow_run.lock"  # beside it: held while a process creates the run (`_create_job_run`)
# A job's start waits this long for MLflow to create its run, then trains without it (MLflow's retries last minutes).
START_WAIT_S = 10.0
CREATE_RETRY_MAX_S = 60.0  # the background creation's backoff cap
# While the server does not answer (tracking.store.unanswered), look again this often before asking MLflow, whose own
# retries back off to minutes (docs/benchmarks/2026-12-03-tracking-outage.md).
DOWN_POLL_S = 5.0
# What MLflow's client reads to reach a server: only in the job's runtime env, never a spec, plan, param or tag.
CREDENTIAL_VARS = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
)


def git_commit(root: Path | str | None = None) -> str:
    """``<sha>`` or ``<sha>-dirty``, or ``"unknown"`` outside a git checkout."""
    cwd = Path(root) if root is not None else PROJECT_ROOT

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def run_tags(
    recipe: str, model: str, world_size: int, *, profile: str | None = None, run_dir: str | None = None
) -> dict[str, str]:
    """A profile's job also gets the profile and the commit, read here: the job's copy of the code has no ``.git``."""
    tags = {keys.RECIPE: recipe, keys.MODEL: model, keys.WORLD_SIZE: str(world_size), keys.STATUS: "running"}
    if profile is not None:
        tags |= {keys.PROFILE: profile, keys.GIT_COMMIT: git_commit()}
    if run_dir is not None:
        tags[keys.RUN_DIR] = run_dir
    return tags


def get_or_create_experiment(client, tracking_uri: str, experiment: str) -> str:
    from mlflow.exceptions import MlflowException  # heavy

    found = client.get_experiment_by_name(experiment)
    if found is not None and found.lifecycle_stage == "deleted":  # MLflow refuses its runs, and keeps its name
        number = found.experiment_id
        raise MlflowException(
            f"experiment {experiment!r} (id {number}) is deleted: restore it with `mlflow experiments restore "
            f"--experiment-id {number}`, or delete it for good with `mlflow gc --experiment-ids {number}` "
            f"(MLFLOW_TRACKING_URI={tracking_uri})"
        )
    if found is not None:
        return found.experiment_id
    try:
        location = default_artifact_location(tracking_uri, experiment)
        return client.create_experiment(experiment, artifact_location=location)
    except MlflowException:  # another process created it since the lookup
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def create_run(
    tracking_uri: str | None,
    experiment: str,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
) -> str:
    """Create the run of one pre-training job; returns its id. ``params`` are flattened (`flatten_config`)."""
    from mlflow import MlflowClient  # heavy
    from mlflow.entities import Param

    if not experiment:
        raise ValueError("create_run: experiment name is empty; pass e.g. the recipe name")
    uri = tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    experiment_id = get_or_create_experiment(client, uri, experiment)
    run = client.create_run(experiment_id, run_name=run_name, tags={str(k): str(v) for k, v in (tags or {}).items()})
    run_id = run.info.run_id
    items = [Param(k, v) for k, v in flatten_config(params or {}).items()]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])
    return run_id


def send_spooled(record: Path | str, timeout_s: float = 120.0) -> tuple[int, int]:
    """Send each spool file's records, oldest first, to the run ``record`` names by now; a file sent in full is
    removed, and the spool folder once it is empty. The first file not sent in full ends the work, so that a server
    that is down costs one close, not one per file; a file that cannot be read is left, with a warning, and the later
    ones are sent. Returns (items sent, files left)."""
    sent, left, folder = 0, 0, spool_dir(record)
    paths = sorted(folder.glob("*.json"))
    for index, path in enumerate(paths):
        try:
            payload = _where_now(json.loads(path.read_text()), record, path)
            # Not spooled again on failure: the file stays, and says what was not sent.
            tracker = Tracker(payload["tracking_uri"], payload["ref"], rank=0, spool=False)
            count = tracker.restore(payload)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:  # cut short, or edited
            print(
                f"warning: spool file {path} cannot be read ({type(error).__name__}: {error}); left in place, "
                "the later ones are sent: delete it only to give up what it holds",
                file=sys.stderr,
                flush=True,
            )
            left += 1
            continue
        tracker.close(timeout_s)
        if tracker.pending:
            left += len(paths) - index
            break
        sent += count
        path.unlink()
        shutil.rmtree(spool_copies_dir(path), ignore_errors=True)
    if not left:
        with contextlib.suppress(OSError):  # absent, or a file another process spooled meanwhile
            folder.rmdir()
    return sent, left


def _where_now(payload: dict[str, Any], record: Path | str, path: Path) -> dict[str, Any]:
    """A spool file's paths, made where its run folder is now (moved, or seen under another mount): the pending run's
    record (every file of a record's spool is that record's), and its artifacts' copies."""
    if payload["ref"].startswith(PENDING_RUN):
        old, payload["ref"] = payload["ref"], pending_run_ref(record)
        for named in (payload["params"], payload["tags"]):
            named.update({key: payload["ref"] for key, value in named.items() if value == old})
    for n, artifact in enumerate(payload["artifacts"]):
        copy = spool_copies_dir(path) / str(n) / Path(artifact[0]).name  # as `spool_copies` names it
        if copy.exists():
            artifact[0] = str(copy)
    return payload


def tracking_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """The `CREDENTIAL_VARS` set in ``environ``."""
    return {name: environ[name] for name in CREDENTIAL_VARS if environ.get(name)}


def open_job_run(
    run_dir: Path,
    tracking_uri: str | None,
    experiment: str,
    config: Mapping[str, Any],
    tags: Mapping[str, Any],
    plan: Mapping[str, Any],
) -> str:
    """The run ``<run_dir>/mlflow_run.json`` records, else a new one (``config`` as params, ``tags``, ``plan.json``)."""
    return _recorded(run_dir, tracking_uri, plan) or _create_job_run(run_dir, tracking_uri, experiment, config, tags)


def start_job_run(
    run_dir: Path,
    tracking_uri: str | None,
    experiment: str,
    config: Mapping[str, Any],
    tags: Mapping[str, Any],
    plan: Mapping[str, Any],
    wait_s: float | None = None,
) -> JobRun:
    """`open_job_run` that never stops the job: after ``wait_s``, the creation goes on on a thread (`JobRun`)."""
    run_id = _recorded(run_dir, tracking_uri, plan)
    run = JobRun(run_dir / RUN_RECORD, tracking_uri, run_id)
    if run_id is not None:  # a relaunch
        return run
    run.create_in_background(lambda: _create_job_run(run_dir, tracking_uri, experiment, config, tags))
    run.wait_for_start(START_WAIT_S if wait_s is None else wait_s)
    return run


class JobRun:
    """A job's MLflow run, which may not exist yet. ``ref`` names it to every Tracker: the run's id if it existed
    within the start's wait, else `pending_run_ref` of the record. The creation retries until MLflow answers or `stop`;
    its first failure, or the end of the start's wait, is one warning line. ``run_id``: once the run exists."""

    def __init__(self, record: Path, tracking_uri: str | None, run_id: str | None = None) -> None:
        self.record = record
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.ref = run_id or pending_run_ref(record)
        self._lock = threading.Lock()  # run_id and ref
        self._created = threading.Event()
        self._settled = threading.Event()  # created, or failed once
        self._stop = threading.Event()
        self._warned = False
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None

    def create_in_background(self, create: Callable[[], str]) -> None:
        self._thread = threading.Thread(target=self._create, args=(create,), name="vitscale-mlflow-run", daemon=True)
        self._thread.start()

    def wait_for_start(self, timeout_s: float) -> None:
        """Wait for the run, a failure or ``timeout_s``; then ``ref`` is fixed."""
        self._settled.wait(timeout_s)
        with self._lock:
            self.ref = self.run_id or self.ref
            if self.run_id is None:
                self._warn_once(f"it did not answer within {timeout_s:g} s")

    def wait(self, timeout_s: float | None = None) -> str | None:
        """The run's id if it exists within ``timeout_s``, else None."""
        if self.run_id is None:
            self._created.wait(timeout_s)
        return self.run_id

    def stop(self, wait_s: float = 0.0) -> None:
        """No further attempt (the job ends); waits up to ``wait_s`` for one in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _create(self, create: Callable[[], str]) -> None:
        delay = 1.0
        while not self._stop.is_set():
            silent = unanswered(self.tracking_uri)
            try:
                if silent:  # said and retried as MLflow's failures are, but sooner
                    raise ConnectionError(silent)
                run_id = create()
            except Exception as error:  # noqa: BLE001 — MLflow down, slow or refusing: the job trains regardless
                with self._lock:
                    self._warn_once(f"it failed: {_reason(error)}")
                if getattr(error, "error_code", None) in _REFUSALS:
                    self._record_refusal(error)
                self._settled.set()
                self._stop.wait(DOWN_POLL_S if silent else delay)
                if not silent:
                    delay = min(2 * delay, CREATE_RETRY_MAX_S)
                continue
            with self._lock:
                self.run_id = run_id
                late = self.ref != run_id and self._warned
            if late:  # said before a waiter goes on with the run: its own lines come after this one
                waited = time.monotonic() - self._started
                print(f"MLflow run {run_id} created after {waited:.0f} s; the buffered records go to it", flush=True)
            self._created.set()
            self._settled.set()
            return

    def _record_refusal(self, error: BaseException) -> None:
        """Record that MLflow refuses the job: closing Trackers then give up at once."""
        refused = {"run_id": None, "tracking_uri": self.tracking_uri, "refused": _reason(error)}
        try:
            write_text_atomically(self.record, json.dumps(refused))
        except OSError:  # the Trackers wait out their close timeout instead
            pass

    def _warn_once(self, what: str) -> None:
        """The caller holds _lock."""
        if self._warned:
            return
        self._warned = True
        print(
            f"warning: MLflow at {self.tracking_uri} could not create the job's run ({what}); training goes on, "
            f"the run's records are buffered and reach MLflow once it answers (run record {self.record})",
            file=sys.stderr,
            flush=True,
        )


# MLflow's codes of a 401 and a 403: credentials the job lacks, not an outage.
_REFUSALS = frozenset({"UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED", "PERMISSION_DENIED"})


def _reason(error: BaseException) -> str:
    """One line on why MLflow failed, with the fix for a refusal (401/403)."""
    summary = " ".join(str(error).split())[:300]
    hint = ""
    if getattr(error, "error_code", None) in _REFUSALS:
        hint = "; check MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN where you launch"
    return f"{type(error).__name__}: {summary}{hint}"


def await_job_run(
    run_dir: Path,
    tracking_uri: str | None,
    experiment: str,
    config: Mapping[str, Any],
    tags: Mapping[str, Any],
    deadline_s: float,
) -> str | None:
    """The run ``run_dir``'s record names once MLflow answers for it, else one created as soon as MLflow answers (a
    job's courier, once the job's own creation stopped), within ``deadline_s``; None if MLflow never answered."""
    recorded = recorded_run_id(run_dir / RUN_RECORD, tracking_uri)
    if recorded is not None:
        return recorded if _answers_for(tracking_uri, recorded, time.monotonic() + deadline_s) else None
    run = JobRun(run_dir / RUN_RECORD, tracking_uri)
    run._warned = True  # the job's start said it: MLflow does not answer
    run.create_in_background(lambda: _create_job_run(run_dir, tracking_uri, experiment, config, tags))
    run.wait(deadline_s)
    run.stop()
    return run.run_id


class RunGoneError(ValueError):
    """MLflow answers, but the run a run folder records is deleted, or gone for good."""


def _answers_for(tracking_uri: str | None, run_id: str, deadline: float) -> bool:
    """Whether MLflow answers for ``run_id`` before ``deadline`` (monotonic), asked every `DOWN_POLL_S`;
    `RunGoneError` when it answers that the run is deleted or gone."""
    while True:
        why = missing_run(tracking_uri, run_id)
        if why:
            raise RunGoneError(why)
        if why is not None:
            return True
        if time.monotonic() + DOWN_POLL_S > deadline:
            return False
        time.sleep(DOWN_POLL_S)


def _recorded(run_dir: Path, tracking_uri: str | None, plan: Mapping[str, Any]) -> str | None:
    """The recorded run a relaunch continues, else None once ``plan.json`` is written."""
    run_id = recorded_run_id(run_dir / RUN_RECORD, tracking_uri)
    why = None if run_id is None else missing_run(tracking_uri, run_id)
    if run_id is not None and not why:
        print(f"continuing MLflow run {run_id} recorded in {run_dir / RUN_RECORD}")
        return run_id
    if why:  # the steps it holds stay there; this job's go to a new run
        print(f"warning: {why}; this job logs to a new MLflow run, which {run_dir / RUN_RECORD} now names", flush=True)
        (run_dir / RUN_RECORD).unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / "plan.json", json.dumps(plan, indent=2))
    return None


def _create_job_run(
    run_dir: Path, tracking_uri: str | None, experiment: str, config: Mapping[str, Any], tags: Mapping[str, Any]
) -> str:
    """Create the run and record it at once (a retry never makes a second one); a Tracker sends the rest. Under the
    run folder's `CREATION_LOCK`: a job's courier and a later job of the folder may both be retrying the creation when
    MLflow answers again; one creates the run, the other waits for its record."""
    params = flatten_config(config, long_keys=True)  # a key MLflow refuses: the Tracker skips it with a warning
    params.pop(keys.RUN_ID_PARAM, None)
    with _creation_lock(run_dir):
        recorded = recorded_run_id(run_dir / RUN_RECORD, tracking_uri)
        if recorded is not None:  # another process of the run folder created it meanwhile
            return recorded
        run_id = create_run(tracking_uri, experiment=experiment, run_name=run_dir.name, tags=tags)
        write_text_atomically(run_dir / RUN_RECORD, json.dumps({"run_id": run_id, "tracking_uri": tracking_uri}))
    tracker = Tracker(tracking_uri, run_id, rank=0, record=run_dir / RUN_RECORD)  # a server failing now: the spool
    tracker.log_params({**params, keys.RUN_ID_PARAM: run_id})
    tracker.log_artifact(str(run_dir / "plan.json"))
    tracker.close()
    return run_id


@contextlib.contextmanager
def _creation_lock(run_dir: Path) -> Iterator[None]:
    """An flock: across nodes on the cluster's shared storage (FSx is mounted with ``-o flock``), and released when
    its holder dies, so a creator killed in its attempt holds no one up."""
    with open(run_dir / CREATION_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:  # a file system without locks: unguarded, as a lone creator needs none
            print(f"warning: {run_dir / CREATION_LOCK} cannot be locked ({error})", file=sys.stderr, flush=True)
        yield


def steps_missing(
    tracking_uri: str | None, run_id: str, wanted: Mapping[int, Mapping[str, float]]
) -> dict[int, dict[str, float]]:
    """Of ``wanted`` (step -> metrics), the steps the run lacks, judged by each step's first key."""
    from mlflow import MlflowClient  # heavy

    client = MlflowClient(tracking_uri=tracking_uri)
    logged: dict[str, set[int]] = {}
    missing = {}
    for step, metrics in wanted.items():
        if not metrics:
            continue
        key = min(metrics)
        if key not in logged:
            logged[key] = {m.step for m in client.get_metric_history(run_id, key)}
        if step not in logged[key]:
            missing[step] = dict(metrics)
    return missing


def standalone_run(
    run_dir: Path, tracking_uri: str | None, experiment: str, run_name: str, params: Mapping[str, Any]
) -> str:
    """The MLflow run of a `python -m pretrain.train` run folder: the one its record names (RUNNING again), else a
    new one, recorded, so that the same command started again continues it, as a relaunched job does."""
    record = run_dir / RUN_RECORD
    run_id = recorded_run_id(record, tracking_uri)
    why = None if run_id is None else missing_run(tracking_uri, run_id)
    if run_id is not None and not why:  # "" it is there; None no answer: the Tracker holds on to what it logs
        if why == "":
            from mlflow import MlflowClient  # heavy

            MlflowClient(tracking_uri=tracking_uri).update_run(run_id, status="RUNNING")
        print(f"continuing MLflow run {run_id} recorded in {record}", flush=True)
        return run_id
    if why:
        print(f"warning: {why}; this run logs to a new MLflow run, which {record} now names", file=sys.stderr)
    run_id = create_run(tracking_uri, experiment, run_name, params, {})
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(record, json.dumps({"run_id": run_id, "tracking_uri": tracking_uri}))
    return run_id


def finish_run(tracking_uri: str | None, run_id: str, status: str, outcome: str | None = None) -> bool:
    """End the run with ``status`` (FINISHED, FAILED); ``vitscale.status`` gets ``outcome`` or ``status.lower()``,
    but a run FINISHED without an ``outcome`` (a Ray job's end or courier) keeps the "stopped" its rank 0 tagged
    (``schedule.stop_at_step``). Whether MLflow took it (else a warning)."""
    from mlflow import MlflowClient  # heavy

    try:
        client = MlflowClient(tracking_uri=tracking_uri)
        tags = client.get_run(run_id).data.tags if status == "FINISHED" else {}
        if outcome is None and status == "FINISHED" and tags.get(keys.STATUS) == "stopped":
            outcome = "stopped"
        if keys.FAILURE in tags:  # an earlier job's: a relaunch finished the run
            client.delete_tag(run_id, keys.FAILURE)
        client.set_tag(run_id, keys.STATUS, outcome or status.lower())
        client.set_terminated(run_id, status=status)
    except Exception as exc:
        print(f"warning: could not mark MLflow run {run_id} {status}: {exc}", file=sys.stderr)
        return False
    return True
