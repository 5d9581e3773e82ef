"""tracking.ui: the MLflow UI command, its loopback-only default, and a real server started on the embedded store."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from cluster.local_head import free_port
from data_pipeline.paths import PROJECT_ROOT
from tracking.runs import create_run
from tracking.ui import _url_host, build_command, check_port_free, main


def test_command_binds_loopback_and_keeps_artifacts_next_to_the_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = build_command(uri, port=5123)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == "5123"
    assert command[command.index("--backend-store-uri") + 1] == uri
    assert command[command.index("--artifacts-destination") + 1] == str(tmp_path / "mlartifacts")


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="not an embedded SQLite store"):
        build_command("http://10.0.0.5:5000")
    with pytest.raises(ValueError, match="does not exist"):
        build_command(f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port + 1}"):
            check_port_free("127.0.0.1", port)
        assert main(["--port", str(port), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 2
    assert "another server uses it" in capsys.readouterr().err
    # An address this machine does not have was "another server uses it — pass a free port".
    elsewhere = "203.0.113.7"  # TEST-NET-3: no machine's own
    assert main(["--host", elsewhere, "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{elsewhere} is not an address of this machine; leave out --host (127.0.0.1)" in err
    assert "another server" not in err
    assert (_url_host("::1"), _url_host("127.0.0.1")) == ("[::1]", "127.0.0.1")  # http://::1:5000 was no URL


def test_a_sqlite_uri_to_a_file_or_folder_that_is_no_database_is_one_line(tmp_path, capsys):
    """`--tracking-uri sqlite:///notes.txt` was started as the server (--dry-run: printed as fine), which died with a
    60-line traceback, exit 1."""
    (tmp_path / "notes.txt").write_text("not a database")
    port = str(free_port())
    for given, what in (("notes.txt", "a file but not an SQLite database"), ("", "a folder")):
        db = tmp_path / given if given else tmp_path
        assert main(["--tracking-uri", f"sqlite:///{db}", "--port", port, "--dry-run"]) == 2
        assert capsys.readouterr().err == (
            "python -m tracking.ui: error: "
            f"tracking store {db} is {what}; pass --tracking-uri sqlite:///<path>/mlflow.db "
            "(the project's store)\n"
        )


def test_help_names_the_store_used_by_default(capsys):
    """Both commands take the project's mlflow.db (tracking.store.default_tracking_uri), not ./mlflow.db: their help
    said ./mlflow.db, another file when run from another folder."""
    from tracking.compare import main as compare_main

    for command in (main, compare_main):
        with pytest.raises(SystemExit):
            command(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"default: MLFLOW_TRACKING_URI, else {PROJECT_ROOT / 'mlflow.db'}, the project's store" in text, text


def test_exposing_the_ui_needs_an_explicit_host_and_warns(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.warns(UserWarning, match="exposes the MLflow UI"):
        assert main(["--host", "0.0.0.0", "--port", str(free_port()), "--tracking-uri", uri, "--dry-run"]) == 0
    assert "--host 0.0.0.0" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_the_path_of_the_sqlite_store_is_taken_as_its_uri(mlflow_uri, tmp_path, monkeypatch, capsys):
    """A plain path was "not an embedded SQLite store; if it is an MLflow server, open it in a browser": the path of
    the database is its sqlite:/// URI; a path that is none gives the exact URI to pass, in one line."""
    db = Path(mlflow_uri.removeprefix("sqlite:///")).resolve()
    create_run(mlflow_uri, "ui-path", "run", {}, {})
    monkeypatch.chdir(db.parent)
    port = str(free_port())
    for given in (db.name, f"./{db.name}", str(db), f"file://{db}"):
        assert main(["--tracking-uri", given, "--port", port, "--dry-run"]) == 0, capsys.readouterr().err
        assert f" --backend-store-uri sqlite:///{db} " in capsys.readouterr().out
    (db.parent / "mlruns").mkdir()
    (db.parent / "notes.txt").write_text("not a database")
    refused = {
        "mlfow.db": f"and no file is there; pass --tracking-uri sqlite:///{db.parent / 'mlfow.db'} (an SQLite store)",
        "mlruns": f"no longer read); pass --tracking-uri sqlite:///{db.parent / 'mlruns' / 'mlflow.db'} (an SQLite",
        "notes.txt": "is a file but not an SQLite database; give the project's store (sqlite:///<path>/mlflow.db)",
    }
    for given, needle in refused.items():
        assert main(["--tracking-uri", given, "--port", port, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"python -m tracking.ui: error: --tracking-uri {given} ") and err.count("\n") == 1, err
        assert needle in err, err
    assert not (db.parent / "mlfow.db").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_ui_serves_the_store_on_loopback_only(mlflow_uri):
    uri = mlflow_uri
    create_run(uri, "ui-check", "visible-run", {"model": {"name": "vit_tiny_debug"}}, {})
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracking.ui", "--port", str(port), "--tracking-uri", uri],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, so the test can stop the server and its workers
    )
    try:
        body = None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=ui-check"
                )
                body = urllib.request.urlopen(request, timeout=5).read().decode()
                break
            except OSError:
                time.sleep(1)
        assert body is not None, f"UI did not answer in 150 s; exit code {proc.poll()}"
        assert '"name": "ui-check"' in body or '"name":"ui-check"' in body
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        # No MLflow job runner (tracking.ui turns it off): its consumer processes only slowed the start.
        assert not [p for p in tree if "huey" in " ".join(_cmdline(p))], [_cmdline(p) for p in tree]
        listening = [c.laddr for p in tree for c in _connections(p) if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.NoSuchProcess:
        return []


def _connections(process: psutil.Process) -> list:
    """A process's inet sockets; none when it exited after the tree was listed (a short-lived child of the server)."""
    try:
        return process.net_connections(kind="inet")
    except (psutil.NoSuchProcess, FileNotFoundError):
        return []
