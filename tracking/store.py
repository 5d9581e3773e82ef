"""Where a run's records live: the tracking URI's defaults, whether its server answers (and for a run), which URIs
failed a call in this process, and the run record (``mlflow_run.json``) and spool that a job's processes share while
MLflow has not created the run (docs/design.md, "Tracking at a job's start"); the names and params MLflow takes.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data_pipeline.paths import PROJECT_ROOT, safe_name

PENDING_RUN = "pending:"  # + the run record's path: a run the job's driver is still creating
SPOOL_DIR = "mlflow_spool"
COURIER_FILE = "mlflow_courier.json"  # the work a job left its courier, until the courier is done
# Sends a run folder's spool and its courier's work in the foreground (`cluster.driver.deliver`, named, not imported)
DELIVER_COMMAND = "python -m cluster.driver.deliver"
PROBE_TIMEOUT_S = 10  # `missing_run`'s one request to a server
# Tracking URI -> when a call to it failed in this process (monotonic), until a send succeeds: a closing Tracker of
# this process then waits no longer than `tracking.tracker.UNANSWERED_CLOSE_S` (MLflow's own retries last minutes).
FAILING_SINCE: dict[str, float] = {}


def default_tracking_uri(root: Path | str | None = None) -> str:
    """``MLFLOW_TRACKING_URI``, else ``sqlite:///<root>/mlflow.db``; never ``./mlruns`` (MLflow >= 3.13 refuses it)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    base = Path(root) if root is not None else PROJECT_ROOT
    return f"sqlite:///{(base / 'mlflow.db').resolve()}"


def default_store_help() -> str:
    """What a command's ``--tracking-uri`` help says of its default (`default_tracking_uri`)."""
    return f"default: MLFLOW_TRACKING_URI, else {PROJECT_ROOT / 'mlflow.db'}, the project's store"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or None for any other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri[len("sqlite:///") :])


SQLITE_HEADER = b"SQLite format 3\x00"  # the first bytes of every SQLite database file


def command_line_uri(given: str | None) -> str:
    """A command's store: ``given`` (``--tracking-uri``), else `default_tracking_uri`. The path of an SQLite database
    file, which MLflow would read as a folder store (./mlruns, refused), is taken as its ``sqlite:///`` URI; another
    plain path is a ValueError naming the exact URI to pass."""
    uri = given or default_tracking_uri()
    try:
        url = urllib.parse.urlsplit(uri)
    except ValueError:  # a malformed URL: MLflow's own error says what is wrong with it
        return uri
    if url.scheme not in ("", "file") or uri.startswith("databricks"):  # databricks[-uc]: MLflow's, not a path
        return uri
    path = Path(url.path if url.scheme else uri).expanduser().resolve()
    if path.is_file() and is_sqlite(path):
        return f"sqlite:///{path}"
    source = f"--tracking-uri {uri}" if given else f"MLFLOW_TRACKING_URI={uri}"
    if path.is_file():
        raise ValueError(
            f"{source} is a file but not an SQLite database; give the project's store "
            "(sqlite:///<path>/mlflow.db) or an MLflow server's URL"
        )
    problem = "it is a folder (MLflow's old file store, no longer read)" if path.is_dir() else "no file is there"
    db = path / "mlflow.db" if path.is_dir() else path
    fix = f"--tracking-uri sqlite:///{db}" if given else f"MLFLOW_TRACKING_URI=sqlite:///{db}"
    raise ValueError(
        f"{source} is a path, not a tracking URI, and {problem}; pass {fix} (an SQLite store) or a server's URL"
    )


def is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError:
        return False
    return head in (SQLITE_HEADER, b"")  # an empty file is an empty database to SQLite


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """An embedded store's artifact folder, next to the database (not ``./mlruns``); None for a server."""
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    return (db.parent / "mlartifacts" / (safe_name(experiment, fill="_") or "experiment")).resolve().as_uri()


def pending_run_ref(record: Path | str) -> str:
    """A Tracker's ``run_id`` for the run ``record`` (``mlflow_run.json``) will name."""
    return f"{PENDING_RUN}{Path(record).resolve()}"


def read_run_record(record: Path | str, tracking_uri: str | None) -> dict[str, Any]:
    """``record``'s ``{"run_id", "tracking_uri"}`` (``"refused"``: MLflow refuses the job's credentials); {} when
    absent, unreadable or another store's."""
    try:
        saved = json.loads(Path(record).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    if (saved.get("tracking_uri") or default_tracking_uri()) != (tracking_uri or default_tracking_uri()):
        return {}
    return saved


def recorded_run_id(record: Path | str, tracking_uri: str | None) -> str | None:
    """The run id of `read_run_record`, or None."""
    return read_run_record(record, tracking_uri).get("run_id") or None


def spool_dir(record: Path | str) -> Path:
    """Where the Trackers of the run ``record`` will name leave what they hold when they close before it exists."""
    return Path(record).parent / SPOOL_DIR


def spool_copies_dir(spool_file: Path) -> Path:
    """Where `spool_copies` keeps a spool file's artifacts; removed with the file once it is sent."""
    return spool_file.with_suffix(".files")


def spool_copies(spool_file: Path, artifacts: list[list[Any]]) -> list[list[Any]]:
    """``[[local_path, artifact_path]]`` with each file or folder copied to `spool_copies_dir`: the original may be
    gone when the spool is sent, e.g. an eval table in a checkpoint that keep_last pruned. One that cannot be copied
    keeps its path."""
    copies = []
    for n, (local, artifact_path) in enumerate(artifacts):
        target = spool_copies_dir(spool_file) / str(n) / Path(local).name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if Path(local).is_dir() else shutil.copy2)(local, target)
            local = str(target)
        except OSError:
            pass
        copies.append([local, artifact_path])
    return copies


def missing_driver(uri: str, error: ImportError) -> str:
    """Why a database URI cannot be read here (postgresql:// without psycopg), and the fix."""
    return (
        f"cannot read the tracking store {uri}: its database driver is not installed ({error}); install the driver "
        "SQLAlchemy names for it into .venv, or pass the URL of an MLflow server"
    )


def unanswered(tracking_uri: str | None, timeout_s: float = 5.0) -> str:
    """Why an HTTP(S) tracking server does not answer: nothing accepts connections at its address, no HTTP response
    comes within ``timeout_s``, or its ``/health`` answers 5xx (a proxy whose server is down); "" when any other status
    comes, and for no server. MLflow retries each call 7 times over ~4 minutes, each up to its 120 s timeout. The probe
    sends no credentials, so its TLS check is left to MLflow's own calls."""
    try:
        url = urllib.parse.urlsplit(tracking_uri or "")
        address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    except ValueError:  # MLflow's own error says what is wrong with it
        return ""
    if url.scheme not in ("http", "https") or not url.hostname:
        return ""
    if url.scheme == "https":
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        connection = http.client.HTTPSConnection(*address, timeout=timeout_s, context=context)
    else:
        connection = http.client.HTTPConnection(*address, timeout=timeout_s)
    try:
        try:
            connection.connect()
        except OSError as error:
            return f"nothing accepts connections at {address[0]}:{address[1]} ({error})"
        try:
            connection.request("GET", url.path.rstrip("/") + "/health")
            response = connection.getresponse()
        except TimeoutError:
            return f"{address[0]}:{address[1]} accepts connections but sends no answer within {timeout_s:g} s"
        except (OSError, http.client.HTTPException):  # it answered, if not as HTTP: MLflow's calls will say how
            return ""
        if response.status >= 500:
            return f"{address[0]}:{address[1]} answers /health with HTTP {response.status} {response.reason}"
        return ""
    finally:
        connection.close()


def failing_calls(tracking_uri: str | None) -> str:
    """Why a server that answers ``/health`` fails MLflow's calls (HTTP 5xx, as when its database is down) or sends
    no answer to one within `PROBE_TIMEOUT_S`; "" when the call succeeds or is refused otherwise (MLflow's own calls
    say how), and for no server. One call, without MLflow's retries of a 5xx, which last minutes."""
    if urllib.parse.urlsplit(tracking_uri or "").scheme not in ("http", "https"):
        return ""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    endpoint = "/api/2.0/mlflow/experiments/search"
    try:
        response = http_request(
            get_default_host_creds(tracking_uri),
            endpoint,
            "POST",
            max_retries=0,
            timeout=PROBE_TIMEOUT_S,
            raise_on_status=False,
            json={"max_results": 1},
        )
    except Exception as error:  # noqa: BLE001 — no answer in time, or the connection failed
        return f"fails a call to {endpoint} ({type(error).__name__}: {' '.join(str(error).split())[:200]})"
    if response.status_code < 500:
        return ""
    try:
        message = str(response.json().get("message", ""))
    except ValueError:
        message = response.text
    message = " ".join(message.split())[:200]
    return f"fails its calls (HTTP {response.status_code} {response.reason}{': ' + message if message else ''})"


def mark_failing(tracking_uri: str | None) -> None:
    """A call to ``tracking_uri`` failed in this process: kept from the first failure until a send succeeds."""
    FAILING_SINCE.setdefault(tracking_uri or "", time.monotonic())


def unserved(tracking_uri: str | None, run_id: str) -> str:
    """Why MLflow cannot take ``run_id``'s records now: `unanswered`'s reasons, or it answers ``/health`` but fails a
    request for the run (its database down, say); "" when it answers for the run, or for a run still pending. Either
    counts as a failed call."""
    why = unanswered(tracking_uri)
    if why:
        mark_failing(tracking_uri)
    elif not run_id.startswith(PENDING_RUN) and _asked_for(tracking_uri, run_id) is None:  # which counts it
        why = f"it answers /health but fails a request for run {run_id}, or takes over {PROBE_TIMEOUT_S} s"
    return why


def missing_run(tracking_uri: str | None, run_id: str) -> str | None:
    """Why MLflow has no active run ``run_id``; "" when it has one; None when it does not answer (a failed call, in
    `FAILING_SINCE`). A server is asked once, for at most `PROBE_TIMEOUT_S`: MLflow's own retries last minutes."""
    if unanswered(tracking_uri):
        mark_failing(tracking_uri)
        return None
    return _asked_for(tracking_uri, run_id)


def _asked_for(tracking_uri: str | None, run_id: str) -> str | None:
    """`missing_run` of a server known to answer ``/health``: one request for the run."""
    from mlflow.exceptions import MlflowException

    try:
        stage = lifecycle_stage(tracking_uri, run_id)
    except Exception as error:  # noqa: BLE001 — down, slow or failing: not an answer
        if isinstance(error, MlflowException) and error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return f"MLflow at {tracking_uri} has no run {run_id}: it was deleted for good (`mlflow gc`)"
        mark_failing(tracking_uri)
        return None
    if stage == "deleted":
        return (
            f"MLflow run {run_id} is deleted (`MLFLOW_TRACKING_URI={tracking_uri} mlflow runs restore --run-id "
            f"{run_id}` brings it back)"
        )
    return ""


def lifecycle_stage(tracking_uri: str | None, run_id: str) -> str:
    """``run_id``'s lifecycle stage; a server is sent one ``runs/get`` (MLflow's REST API) without retries."""
    if urllib.parse.urlsplit(tracking_uri or "").scheme not in ("http", "https"):
        from mlflow import MlflowClient  # heavy

        return MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.lifecycle_stage
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    endpoint = "/api/2.0/mlflow/runs/get"
    creds = get_default_host_creds(tracking_uri)
    response = http_request(creds, endpoint, "GET", max_retries=0, timeout=PROBE_TIMEOUT_S, params={"run_id": run_id})
    return verify_rest_response(response, endpoint).json()["run"]["info"]["lifecycle_stage"]


# MLflow's limits (mlflow.utils.validation): one over fails the whole batch.
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
# MLflow's errors no retry fixes: the batch is dropped with a warning.
PERMANENT_ERROR_CODES = frozenset(
    {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS"}
)


def flatten_config(config: Mapping[str, Any], prefix: str = "", *, long_keys: bool = False) -> dict[str, str]:
    """``{"optim": {"lr": 1e-3}} -> {"optim.lr": "0.001"}``; long values truncated, a too-long key ``ValueError``
    unless ``long_keys`` (kept: a Tracker skips it with a warning)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, prefix=f"{name}.", long_keys=long_keys))
            continue
        if isinstance(value, (list, tuple)):
            text = json.dumps(list(value), default=str)
        elif isinstance(value, Mapping):
            text = "{}"
        else:
            text = str(value)
        if len(name) > MAX_KEY_LENGTH and not long_keys:
            raise ValueError(f"config key {name!r} is longer than MLflow's {MAX_KEY_LENGTH}-character limit")
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            marker = f"...[truncated, {len(text)} chars]"
            text = text[: MAX_PARAM_VALUE_LENGTH - len(marker)] + marker
        flat[name] = text
    return flat


def refused_name(name: str) -> str:
    """Why MLflow refuses a metric, param or tag named ``name`` (`mlflow.utils.validation`); "" if it takes it."""
    from mlflow.utils import validation  # heavy

    if not validation.validate_param_and_metric_name(name):
        return validation.bad_character_message()
    if validation.path_not_unique(name):
        return validation.bad_path_message(name)
    if len(name) > validation.MAX_ENTITY_KEY_LENGTH:
        return f"Names may be at most {validation.MAX_ENTITY_KEY_LENGTH} characters long."
    return ""
