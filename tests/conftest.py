"""Suite-wide settings: CPU DeepSpeed, GPU tests skipped with a reason when no CUDA device is present, and the
order options: ``--shuffle SEED`` runs the tests in a random order drawn from SEED (`make test-shuffled`), ``--reverse``
in reverse order. Every test must pass alone, in the suite, and in either order.

Without either option the longest tests start first: ``tests/durations.json`` holds each test's seconds from a
measured run (``--write-durations`` rewrites it), and the tests run longest first, the rest in collection order
after them; those marked ``waits`` are kept apart (``tests/support/order.py``). With `make test`'s ``--dist load``,
xdist hands each worker the next test as it frees up, so a four-minute end-to-end test no longer starts in the last
minutes of the run and becomes its tail.

What several tests only read (generated shards, tiny trainings whose summaries and checkpoints they compare) is made
once per pytest run, however many pytest-xdist workers ask for it: ``shared_folder``."""

import contextlib
import fcntl
import http.server
import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Tests import helpers from one another (`from tests.pretrain.test_train_distributed import ...`): the repository root
# on the path, also when pytest is started as `pytest` rather than `python -m pytest` (which adds the working
# directory).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.local_head import free_port  # noqa: E402 — after the path is set
from tests.support.order import order  # noqa: E402

# DeepSpeed picks its accelerator at import time; the suite runs on CPU unless a GPU test asks otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Three xdist workers share two cores, and between parallel regions torch's OpenMP threads spin-wait for work (the
# libgomp default), burning the cores the other workers need. Waiting passively (they sleep) took three in-process
# test files from 193 to 140 CPU-s (docs/benchmarks/2026-11-28-test-suite.md). Read when torch loads libgomp, so set
# before any import of torch; the processes tests start inherit it. A scheduling policy: the numerics are unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# gcsfs's default filesystem asks Google's storage control API (gRPC) about each bucket first, waiting up to 60 s
# where it cannot be reached; no test reaches Google. Read when gcsfs is imported (a plan imports it for gs://).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


DURATIONS = ROOT / "tests" / "durations.json"
RECORDED_FROM = 5.0  # seconds: shorter tests keep their collection order, after the recorded ones


def pytest_addoption(parser):
    group = parser.getgroup("vitscale order")
    group.addoption(
        "--shuffle", metavar="SEED", type=int, default=None, help="run the tests in an order drawn from SEED"
    )
    group.addoption("--reverse", action="store_true", help="run the tests in reverse order")
    group.addoption(
        "--write-durations",
        action="store_true",
        help=f"rewrite {DURATIONS.relative_to(ROOT)} with this run's seconds per test (the longest-first order)",
    )


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return (
        None if seed is None else f"test order shuffled with --shuffle {seed} (rerun with the same seed to repeat it)"
    )


def pytest_collection_modifyitems(config, items):
    import torch

    # Every worker of a distributed run collects the same items and must order them the same way: a seeded shuffle.
    if config.getoption("--shuffle") is not None:
        random.Random(config.getoption("--shuffle")).shuffle(items)
    if config.getoption("--reverse"):
        items.reverse()
    if config.getoption("--shuffle") is None and not config.getoption("--reverse"):
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        waiting = {item.nodeid for item in items if "waits" in item.keywords}
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        by_name = {item.nodeid: item for item in items}
        items[:] = [by_name[name] for name in order([item.nodeid for item in items], seconds, waiting, workers)]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none on this machine); runs on the GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # In an xdist run the controller sees every worker's reports; setup and teardown count (shared builds happen there).
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--write-durations") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    recorded = {k: round(v, 1) for k, v in sorted(_measured.items(), key=lambda kv: -kv[1]) if v >= RECORDED_FROM}
    DURATIONS.write_text(json.dumps(recorded, indent=0) + "\n")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The measured GEMM peaks (pretrain.telemetry.peak) go to a cache of this pytest run's own, shared by its xdist
    workers (each peak measured once per run, not once per worker; the cache file is replaced atomically): tests
    neither read nor write the user's ~/.cache/vitscale."""
    previous = os.environ.get("VITSCALE_CACHE")
    cache = _run_root(tmp_path_factory) / "vitscale_cache"
    cache.mkdir(exist_ok=True)
    os.environ["VITSCALE_CACHE"] = str(cache)
    yield
    if previous is None:
        os.environ.pop("VITSCALE_CACHE", None)
    else:
        os.environ["VITSCALE_CACHE"] = previous


@pytest.fixture(autouse=True)
def no_ray_auth_leak():
    """A test that starts Ray in this process sets RAY_AUTH_MODE through `cluster.local_head.ray_auth_mode`: a
    `ray.init()` of a local instance with it unset turns token auth on for the rest of the pytest process, and later
    tests' auth-off clusters then had every actor cancelled (docs/elastic.md). Fails the leaking test, not a victim."""
    before = os.environ.get("RAY_AUTH_MODE")
    yield
    after = os.environ.get("RAY_AUTH_MODE")
    assert after == before, f"this test left RAY_AUTH_MODE={after!r} (was {before!r}); start Ray inside ray_auth_mode()"


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: on 2 shared cores, torch's own threads only contend with the other test processes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def only_new_objects_scanned():
    """``gc.get_objects()`` lists only the objects made after this point: `gc.freeze` moves the others (a long-lived
    test worker's millions, which every scan read and every `gc.collect` walked) to the permanent generation that
    both skip. What the test makes is made later, so each scan still sees all of it."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _run_root(tmp_path_factory) -> Path:
    """This pytest run's folder that all its xdist workers see: their base temps' common parent (one per run, never
    an earlier run's); without xdist, the base temp itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def shared_folder(tmp_path_factory) -> Callable[[str, Callable[[Path], object]], Path]:
    """``shared_folder(key, build)``: the folder ``key`` of this pytest run, filled by ``build(folder)`` once however
    many xdist workers ask: the first takes the key's lock (fcntl) and builds, the others wait on it and reuse what it
    built. A build that raised leaves no folder behind (the next caller builds again). What is built is the readers'
    to read, never to change: a test that damages or resumes a shared run works on a copy."""
    root = _run_root(tmp_path_factory) / "shared"
    root.mkdir(exist_ok=True)

    def get(key: str, build: Callable[[Path], object]) -> Path:
        folder = root / key
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
            if not (folder / ".built").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                try:
                    build(folder)
                except BaseException:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise
                (folder / ".built").touch()
        return folder

    return get


@pytest.fixture(scope="session")
def tiny_fractal_shards(tmp_path_factory) -> Path:
    """A tiny fractal set at 32 px: 4 classes x 16 images in 4 shards (2 ranks need >= 2 shards), generated once per
    pytest run (`ensure` locks the folder: concurrent workers wait, then find it complete), at one path for every
    worker, so runs shared between workers (``shared_folder``) name the shards their readers name."""
    from data_pipeline.builtin.sets import ensure

    root = _run_root(tmp_path_factory) / "data"
    ensure("fractal", root, resolution=32, num_classes=4, images_per_class=16, val_per_class=1, samples_per_shard=16)
    return root / "fractal" / "train"


@pytest.fixture(scope="session")
def eval_data_root(tmp_path_factory) -> Path:
    """A data root holding the built-in digits and dsprites_loc at their default sizes, generated once per pytest run
    like ``tiny_fractal_shards`` (about 7 s each time it is built), for tests that read them and never write there."""
    from data_pipeline.builtin.sets import ensure

    root = _run_root(tmp_path_factory) / "eval_data"
    for name in ("digits", "dsprites_loc"):
        ensure(name, root)
    return root


@pytest.fixture(scope="session")
def local_demo_data(tmp_path_factory) -> Path:
    """A shard root holding local_demo's training set (rcdb, 64 classes x 60 images at 32 px, as the recipe builds
    it), generated once per pytest run like ``tiny_fractal_shards``: what `make launch` writes under the project's
    data/, never written there."""
    from data_pipeline.builtin.sets import ensure
    from pretrain.config.train_config import load_config

    root = _run_root(tmp_path_factory) / "local_demo_data"
    config = load_config("local_demo")
    ensure(config.data.builtin, root, **config.data.builtin_options)
    return root


@pytest.fixture
def mlflow_uri(tmp_path, shared_folder) -> str:
    """The URI of a new, empty MLflow tracking store (SQLite) of this test's own, ``tmp_path / "mlflow.db"``: a copy
    of one made once per pytest run. A store made anew runs MLflow's schema migrations (measured: 5 s each on the
    loaded 2-core machine, against 0.3 s for a copy); its named experiments keep their artifacts beside the copy."""

    def build(folder: Path) -> None:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}").search_experiments()  # makes the tables

    shutil.copyfile(shared_folder("mlflow-store", build) / "mlflow.db", tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def train_env() -> Callable[[], dict[str, str]]:
    """The environment of a standalone (one-process) training run, made from ``os.environ`` when called (so a test's
    monkeypatched variables are in it): CPU, one thread, this checkout importable, no torchrun variables."""

    def make() -> dict[str, str]:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(key, None)
        return env

    return make


@pytest.fixture
def train_cli(train_env):
    """Run `python -m pretrain.train` on a TrainConfig as one standalone process (no torchrun variables), forked
    from an interpreter that has imported what it imports (`tests/support/warm_ranks.py`; a timeout kills it and what it
    started), and return its summary; the config is saved as `<run_dir>/recipe.yaml` first, what it printed is
    `<run_dir>/output.log`. ``fails=True``: the run must end with a non-zero status (returns None)."""
    from tests.support import warm_ranks

    def run(config, run_dir: Path, timeout: float = 400, fails: bool = False) -> dict | None:
        run_dir.mkdir(parents=True, exist_ok=True)
        config.save(run_dir / "recipe.yaml")
        log = run_dir / "output.log"
        log.write_text("")
        args = ["--config", str(run_dir / "recipe.yaml"), "--summary", str(run_dir / "summary.json")]
        try:
            status = warm_ranks.launch("pretrain.train", args, 1, train_env(), log, timeout, ranks=False)
        except TimeoutError:
            pytest.fail(f"training timed out:\n{log.read_text()[-4000:]}")
        out = log.read_text()
        if fails:
            assert status != 0, out[-6000:]
            return None
        assert status == 0, out[-6000:]
        return json.loads((run_dir / "summary.json").read_text())

    return run


@contextlib.contextmanager
def _local_server(name: str, command: list[str], url: str, log: Path, timeout_s: float = 60.0):
    """Run ``command`` (a storage server on 127.0.0.1) until it answers ``url``; stopped on leaving."""
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                pytest.fail(f"{name} exited with {server.returncode}:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{name} did not answer at {url} within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def s3_endpoint(tmp_path, monkeypatch):
    """A real S3-compatible server of this test's own (moto's, on a free 127.0.0.1 port), and the environment that
    points S3 clients at it with dummy credentials, as for any S3 client: ``AWS_ENDPOINT_URL`` (botocore, under
    s3fs), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``. Processes started after it (a Ray node, a CLI) inherit
    them. Stopped at the end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _local_server("moto server", command, url, tmp_path / "moto.log"):
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))  # the user's files stay unread
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        yield url


@pytest.fixture
def gcs_endpoint(tmp_path, monkeypatch):
    """A real GCS-compatible server of this test's own (gcp-storage-emulator's JSON API, in memory, on a free
    127.0.0.1 port), and the environment that points Google Cloud Storage clients at it, as for any GCS client:
    ``STORAGE_EMULATOR_HOST`` (gcsfs's endpoint), anonymous credentials (``NO_GCE_CHECK``: no metadata server asked;
    no user gcloud config read); gcsfs's plain JSON-API filesystem (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``, set above
    for every test: an emulator serves no control API). Stopped at the end."""
    import fsspec

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "-H", "127.0.0.1", "--port", str(port)]
    command += ["--in-memory", "--quiet"]
    with _local_server("GCS emulator", command, f"{url}/storage/v1/b", tmp_path / "gcs.log"):
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud-config"))  # the user's files stay unread
        monkeypatch.setenv("NO_GCE_CHECK", "true")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        import gcsfs.core

        # This process: the plain filesystem even if gcsfs was imported before, and no instance of another endpoint.
        monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", gcsfs.core.GCSFileSystem)
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        assert fsspec.filesystem("gs").__class__ is gcsfs.core.GCSFileSystem
        yield url
        gcsfs.core.GCSFileSystem.clear_instance_cache()


class FakeServer(http.server.ThreadingHTTPServer):
    """A fake server in the test's process that keeps quiet when a client hangs up before reading the whole answer (a
    storage client that read a 403's status): socketserver prints that BrokenPipeError's traceback to this process's
    stderr, in the middle of the one error line a test asserts of the command it runs here."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def refusing_store(monkeypatch):
    """An HTTP server answering 403 to every request, as S3 and GCS do to wrong credentials, and the environment
    that points both clients at it (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``); no cached client of another
    endpoint is reused. Yields its URL; stopped at the end."""
    import threading

    import gcsfs.core
    import s3fs

    class Refusing(http.server.BaseHTTPRequestHandler):
        def refuse(self) -> None:
            body = b'{"error": {"code": 403, "message": "denied"}}'
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":  # a body after a HEAD's headers would garble the connection's next answer
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = refuse

        def log_message(self, *args) -> None:
            pass

    server = FakeServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    for name, value in [("AWS_ENDPOINT_URL", url), ("STORAGE_EMULATOR_HOST", url), ("NO_GCE_CHECK", "true")]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    for cls in (gcsfs.core.GCSFileSystem, s3fs.S3FileSystem):
        cls.clear_instance_cache()
    try:
        yield url
    finally:
        server.shutdown()
        for cls in (gcsfs.core.GCSFileSystem, s3fs.S3FileSystem):
            cls.clear_instance_cache()


@pytest.fixture
def failing_mlflow(monkeypatch):
    """An HTTP server whose ``/health`` answers 200 while every other request gets 500, as an MLflow server whose
    database is down does, with MLflow's default retries set (7 over ~4 min). Yields its URI; stopped at the end."""
    import threading

    class DatabaseDown(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.send_error(200 if self.path == "/health" else 500)

        do_GET = do_POST = answer

        def log_message(self, *args) -> None:
            pass

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    server = FakeServer(("127.0.0.1", 0), DatabaseDown)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
