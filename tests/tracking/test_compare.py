"""tracking.compare on a real MLflow SQLite store: runs logged the way training and evals log them (via Tracker)."""

import csv
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_pipeline.paths import PROJECT_ROOT
from tracking import keys
from tracking.compare import main
from tracking.report_collect import collect
from tracking.report_render import CSV_NAME, FEWSHOT_PNG, LOSS_PNG, draw_fewshot, format_table
from tracking.runs import create_run, finish_run, run_tags
from tracking.tracker import Tracker

pytestmark = pytest.mark.timeout(180)

BATCH = 64


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _log_run(uri, experiment, name, *, model, recipe, steps, gflops, evals_at=(), status="FINISHED", seed=0):
    """Log a pre-training run like the driver + rank 0 + eval tasks do; returns (run_id, what was logged)."""
    rng = np.random.default_rng(seed)
    config = {"model": {"name": model}, "optim": {"lr": 1e-3}, "data": {"global_batch_size": BATCH}}
    run_id = create_run(uri, experiment, name, config, run_tags(recipe, model, 2, profile="local"))
    logged = {"loss": {}, "fewshot": {}}
    with Tracker(uri, run_id, rank=0) as tracker:
        for step in range(1, steps + 1):
            loss = float(4.0 * math.exp(-step / 40) + 0.5 + 0.05 * rng.random())
            images = step * BATCH
            tracker.log_metrics(
                {
                    "train/loss": loss,
                    "train/lr": 1e-3,
                    "train/images_seen": images,
                    "train/exaflops": images * 3 * gflops * 1e9 / 1e18,
                },
                step=step,
            )
            logged["loss"][step] = loss
        for i, step in enumerate(evals_at):
            acc = 0.2 + 0.1 * i + 0.01 * seed
            tracker.log_metrics(
                {
                    "fewshot/digits/10shot": acc,
                    "fewshot/shapes_count/10shot": acc - 0.04,
                    "fewshot/mean/10shot": acc - 0.02,
                    "fewshot/l2/10shot": 1024.0,
                    "finetune/digits/accuracy": acc + 0.3,
                    "finetune/digits/lr": 0.01,
                    "finetune/dsprites_loc/accuracy": acc + 0.1,
                    "vtab/digits": acc + 0.05,
                    "vtab/dsprites_loc": acc,
                    "vtab/mean": acc + 0.025,
                    "vtab/natural": acc + 0.05,
                    "vtab/num_tasks": 2,
                    "vtab/num_tasks_expected": 19,
                },
                step=step,
            )
            logged["fewshot"][step] = acc - 0.02
        tracker.set_tags({keys.STATUS: status.lower()})
    _client(uri).set_terminated(run_id, status=status)
    return run_id, logged


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = {
        "b16": _log_run(
            uri,
            "scaling",
            "b16-run",
            model="vit_b16",
            recipe="vit_b16_i21k",
            steps=60,
            gflops=17.6,
            evals_at=(0, 20, 40, 60),
            seed=1,
        ),
        "ti": _log_run(
            uri,
            "scaling",
            "tiny-run",
            model="vit_tiny_debug",
            recipe="local_demo",
            steps=80,
            gflops=0.05,
            evals_at=(40, 80),
            seed=2,
        ),
    }
    _client(uri).log_param(runs["ti"][0], "model.patch_size", 4)  # the model's patch size, if the run logged it
    return uri, root, runs


@pytest.fixture(scope="module")
def two_run_report(store):
    uri, root, runs = store
    out = root / "reports"
    assert main(["--experiment", "scaling", "--tracking-uri", uri, "--out", str(out), "--name", "two"]) == 0
    return out / "two"


def test_table_numbers_equal_what_was_logged(store):
    uri, _, runs = store
    comparison = collect(_client(uri), uri, experiment="scaling")
    by_name = {r.run_name: r for r in comparison.runs}
    assert set(by_name) == {"b16-run", "tiny-run"}
    b16 = by_name["b16-run"]
    logged = runs["b16"][1]
    # b16-run logged no patch size: the report reads it from the model name (it does not import the model registry).
    assert (b16.model, b16.patch, b16.recipe, b16.status) == ("vit_b16", 16, "vit_b16_i21k", "FINISHED")
    assert b16.steps == 60 and b16.images_seen == 60 * BATCH
    assert b16.final_loss == pytest.approx(logged["loss"][60], rel=1e-12)
    assert b16.exaflops == pytest.approx(60 * BATCH * 3 * 17.6e9 / 1e18, rel=1e-12)
    assert b16.fewshot_10shot == pytest.approx(0.2 + 0.3 + 0.01 - 0.02)  # latest checkpoint (step 60)
    assert b16.finetune_accuracy == pytest.approx(((0.51 + 0.3) + (0.51 + 0.1)) / 2)
    assert b16.finetune_datasets == ("digits", "dsprites_loc")
    assert (b16.vtab_mean, b16.vtab_num_tasks, b16.vtab_num_tasks_expected) == (pytest.approx(0.535), 2, 19)
    # Step 0 (the weights before the first update) is the baseline, not a point of the log-compute curve.
    assert [step for _, _, step in b16.fewshot_curve] == [20, 40, 60]
    assert [acc for _, acc, _ in b16.fewshot_curve] == pytest.approx([logged["fewshot"][s] for s in (20, 40, 60)])
    assert b16.fewshot_baseline == pytest.approx(logged["fewshot"][0])
    assert b16.fewshot_gain == pytest.approx(logged["fewshot"][60] - logged["fewshot"][0])
    assert [s for s, _ in b16.fewshot_gains] == [20, 40, 60]
    assert [g for _, g in b16.fewshot_gains] == pytest.approx([0.1, 0.2, 0.3])
    assert len(b16.loss_curve) == 60 and b16.loss_curve[-1] == (60 * BATCH, pytest.approx(logged["loss"][60]))
    assert "VTAB mean covers 2 of 19 tasks" in b16.notes
    tiny = by_name["tiny-run"]
    assert (tiny.patch, tiny.steps, tiny.images_seen) == (4, 80, 80 * BATCH)  # the logged patch size
    assert tiny.fewshot_baseline is None and tiny.fewshot_gain is None and not tiny.fewshot_gains
    assert any(n.startswith("no step-0 fewshot/mean/10shot") for n in tiny.notes)


def test_fewshot_plot_draws_each_runs_step0_baseline(store):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    uri, _, runs = store
    comparison = collect(_client(uri), uri, experiment="scaling")
    ax = Figure().subplots()
    notes = draw_fewshot(ax, comparison.runs)
    base = 100 * runs["b16"][1]["fewshot"][0]
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(dashed) == 1  # b16-run's baseline; tiny-run has no step 0
    assert list(dashed[0].get_ydata()) == pytest.approx([base, base])
    assert dashed[0].get_label() == f"b16-run: step 0 {base:.1f}%"
    assert any(t.get_text() == "step 0 (random init)" for t in ax.texts)
    assert notes == ["tiny-run: no step-0 evaluation, so no baseline line"]


def test_report_files_csv_and_mlflow_artifacts(store, two_run_report):
    uri, _, runs = store
    for name in ("index.html", LOSS_PNG, FEWSHOT_PNG, CSV_NAME):
        assert (two_run_report / name).stat().st_size > 0, name
    rows = {r["run_name"]: r for r in csv.DictReader((two_run_report / CSV_NAME).open())}
    assert float(rows["b16-run"]["final_loss"]) == runs["b16"][1]["loss"][60]  # full precision, exactly
    assert int(rows["tiny-run"]["steps"]) == 80 and float(rows["tiny-run"]["images_seen"]) == 80 * BATCH
    page = (two_run_report / "index.html").read_text()
    assert "b16-run" in page and "tiny-run" in page and "3,840" in page and "5,120" in page
    assert "53.5% (2/19 tasks)" in page and "71.0% (mean of 2)" in page and "49.0%" in page
    # Each checkpoint's gain over step 0, in the table (latest), under the figure (every checkpoint) and the CSV.
    gains = "10-shot mean over step 0 (19.0%): step 20 +10.0 pp, step 40 +20.0 pp, step 60 +30.0 pp"
    assert "+30.0 pp" in page and gains in page
    assert float(rows["b16-run"]["fewshot_10shot_gain"]) == pytest.approx(0.3)
    assert rows["tiny-run"]["fewshot_10shot_step0"] == ""
    table = format_table(collect(_client(uri), uri, experiment="scaling"))
    assert "Gain vs step 0" in table and f"gain [b16-run]: {gains}" in table
    # The report went to MLflow as a comparison run, which later comparisons leave out.
    client = _client(uri)
    experiment = client.get_experiment_by_name("scaling")
    comparisons = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get(keys.KIND)]
    assert len(comparisons) == 1
    artifacts = {a.path for a in client.list_artifacts(comparisons[0].info.run_id, "report")}
    assert {"report/index.html", f"report/{LOSS_PNG}", f"report/{FEWSHOT_PNG}", f"report/{CSV_NAME}"} <= artifacts
    assert len(collect(client, uri, experiment="scaling").runs) == 2


def test_crashed_run_and_run_without_evals_are_noted(store, tmp_path):
    uri, _, _ = store
    crashed, _ = _log_run(uri, "mixed", "crashed", model="vit_s16", recipe="r", steps=5, gflops=4.6, status="FAILED")
    running, _ = _log_run(uri, "mixed", "no-evals", model="vit_s16", recipe="r", steps=8, gflops=4.6, status="RUNNING")
    bare = create_run(uri, "mixed", "no-metrics", {}, {})  # the driver created it, then nothing arrived
    # A standalone trainer tags its outcome but leaves the MLflow run RUNNING: the tag decides.
    died, _ = _log_run(uri, "mixed", "tagged-failed", model="vit_s16", recipe="r", steps=3, gflops=1, status="RUNNING")
    _client(uri).set_tag(died, keys.STATUS, "failed")
    # Died after its step-0 baseline eval, before any later checkpoint.
    only0, _ = _log_run(
        uri, "mixed", "only-step0", model="vit_s16", recipe="r", steps=4, gflops=1, evals_at=(0,), status="FAILED"
    )
    # Only a named suite entry's metrics (`name: vtab1k_probe`), beside the job's own namespaces: evaluated.
    named, _ = _log_run(uri, "mixed", "named", model="vit_s16", recipe="r", steps=4, gflops=1, status="RUNNING")
    _client(uri).log_metric(named, "vtab1k_probe/mean", 0.3, step=4)
    for key in (keys.GOODPUT_WALL_S, keys.HANGS_METRIC, keys.data_count("read_retries"), keys.eval_failed("s")):
        _client(uri).log_metric(running, key, 1.0, step=8)  # no eval in these
    # VTAB scored 2 tasks at step 4, none at step 8 (its data gone: counts logged, no mean): one step's numbers.
    vtab = {4: {keys.VTAB_MEAN: 0.6, keys.VTAB_NUM_TASKS: 2}, 8: {keys.VTAB_NUM_TASKS: 0}}
    for step, logged in vtab.items():
        for key, value in {**logged, keys.VTAB_NUM_TASKS_EXPECTED: 19}.items():
            _client(uri).log_metric(named, key, value, step=step)
    # Fine-tuned on two datasets at step 4, on one at step 8: the column is step 8's, not a mix of both steps.
    tuned = {4: {"digits": 0.5, "dsprites_loc": 0.9}, 8: {"digits": 0.7}}
    for step, accuracies in tuned.items():
        for dataset, value in accuracies.items():
            _client(uri).log_metric(named, keys.finetune_accuracy(dataset), value, step=step)
    runs = {r.run_name: r for r in collect(_client(uri), uri, run_ids=(named, running)).runs}
    assert (runs["named"].finetune_accuracy, runs["named"].finetune_datasets) == (0.7, ("digits",))
    said = "fine-tune at step 8 has no dsprites_loc (scored at earlier steps): the column is the mean of that step's 1"
    assert said in runs["named"].notes
    assert (runs["named"].vtab_mean, runs["named"].vtab_num_tasks, runs["named"].vtab_num_tasks_expected) == (
        0.6,
        2,
        19,
    )
    assert "VTAB at step 8 scored no task: the VTAB column is step 4's" in runs["named"].notes
    notes = {name: run.notes for name, run in runs.items()}
    assert not any("no eval metrics" in n for n in notes["named"])
    failed = "no eval metrics logged (every eval failed: eval_failed/s; see the run's eval_failures/)"
    assert failed in notes["no-evals"]  # its checkpoints were evaluated: "no checkpoint evaluated yet" before
    out = tmp_path / "reports"
    ids = ",".join([crashed, running, bare, died, only0])
    assert main(["--runs", ids, "--tracking-uri", uri, "--out", str(out), "--name", "m"]) == 0
    page = (out / "m" / "index.html").read_text()
    assert "tagged-failed: run FAILED (crashed) at step 3" in page
    assert "crashed: run FAILED (crashed) at step 5" in page
    assert "no-evals: run still RUNNING" in page
    assert "no-metrics: run still RUNNING (or crashed without reporting); no step logged yet; no training" in page
    assert page.count("no eval metrics logged") == 4
    assert "No run has few-shot 10-shot results" not in page  # the placeholder text lives in the PNG
    assert "no-evals: no few-shot eval logged" in page
    assert "only-step0: only step 0 evaluated so far (no checkpoint after it)" in page
    # Its latest 10-shot mean is step 0's own: no gain yet, not "+0.0 pp" beside the runs that gained something.
    [step0] = collect(_client(uri), uri, run_ids=(only0,)).runs
    assert step0.fewshot_10shot == step0.fewshot_baseline == pytest.approx(0.18) and step0.fewshot_gain is None
    assert Image.open(out / "m" / FEWSHOT_PNG).size[0] > 100


def test_a_run_stopped_at_its_stop_step_is_stopped_not_finished(mlflow_uri, tmp_path):
    """A standalone run that reached `schedule.stop_at_step` ends its MLflow run FINISHED, tagged vitscale.status
    'stopped' (pretrain.loop): the report took MLflow's FINISHED and ranked it with the runs that trained to the end
    of their schedules, its line solid and no note."""
    run_id, _ = _log_run(mlflow_uri, "stop", "half", model="vit_s16", recipe="r", steps=6, gflops=1, status="RUNNING")
    assert finish_run(mlflow_uri, run_id, "FINISHED", "stopped")  # as pretrain.loop ends it
    [run] = collect(_client(mlflow_uri), mlflow_uri, experiment="stop").runs
    assert run.status == "STOPPED" and "run stopped before the end of its schedule, at step 6" in run.notes


def test_a_hybrids_patch_is_its_names_not_its_vits_patch_on_the_resnet_features(mlflow_uri):
    """pretrain.loop logs `model.patch_size` as the ViT's patch on its input: 1 for a hybrid, whose ResNet stem does
    the downsampling. R50+ViT-B/16 showed as Patch 1 beside ViT-B/16's 16; its tokens are 16x16 pixels, as its name
    says."""
    client = _client(mlflow_uri)
    for model, patch in (("r50_vit_b16", 1), ("vit_b16", 16), ("vit_tiny_debug", 4)):
        run_id = create_run(mlflow_uri, "hybrid", model, {"model": {"name": model}}, run_tags("r", model, 2))
        client.log_param(run_id, "model.patch_size", patch)  # as pretrain.loop logs it
    runs = collect(client, mlflow_uri, experiment="hybrid").runs
    assert {r.model: r.patch for r in runs} == {"r50_vit_b16": 16, "vit_b16": 16, "vit_tiny_debug": 4}


def test_infinities_an_sql_store_kept_as_the_largest_float_are_no_numbers(mlflow_uri, tmp_path, capsys):
    """MLflow's SQL stores keep +-inf as +-1.797e308, which runs logged before the Tracker sent NaN hold: a finite
    number to every reader. The report showed it as a loss, and stopped in matplotlib on the loss plot."""
    from mlflow.entities import Metric

    client = _client(mlflow_uri)
    run_id = create_run(mlflow_uri, "old", "inf-run", {}, run_tags("r", "vit_s16", 2))
    inf = float("inf")
    points = {1: 3.0, 2: 2.5, 3: inf, 4: -inf}
    metrics = [Metric(keys.LOSS, v, 1000 + s, s) for s, v in points.items()]
    metrics += [Metric(keys.IMAGES_SEEN, 64.0 * s, 1000 + s, s) for s in points]
    metrics += [Metric(keys.EXAFLOPS, 1e-6 * s, 1000 + s, s) for s in points]
    metrics += [Metric(keys.FEWSHOT_MEAN_10SHOT, v, 1000 + s, s) for s, v in ((0, 0.1), (2, 0.3), (4, inf))]
    metrics += [Metric(keys.GOODPUT_WALL_S, inf, 2000, 4), Metric(keys.goodput_bucket("productive"), 3.0, 2000, 4)]
    metrics += [Metric(keys.finetune_accuracy("digits"), -inf, 2000, 4), Metric(keys.VTAB_MEAN, inf, 2000, 4)]
    client.log_batch(run_id, metrics=metrics)
    assert client.get_run(run_id).data.metrics[keys.VTAB_MEAN] == 1.7976931348623157e308  # as the store keeps it
    client.set_terminated(run_id)
    [run] = collect(client, mlflow_uri, experiment="old").runs
    assert (run.final_loss, [loss for _, loss in run.loss_curve]) == (2.5, [3.0, 2.5])
    assert (run.fewshot_10shot, run.finetune_accuracy, run.vtab_mean) == (None, None, None)
    assert [(step, acc) for _, acc, step in run.fewshot_curve] == [(2, 0.3)]
    assert run.goodput.wall_s == 3.0  # the buckets' sum, as without a logged wall-clock
    out = tmp_path / "reports"
    assert main(["--experiment", "old", "--tracking-uri", mlflow_uri, "--out", str(out), "--no-mlflow"]) == 0
    printed = capsys.readouterr().out + (out / "old" / CSV_NAME).read_text() + (out / "old" / "index.html").read_text()
    assert "e+308" not in printed and "1.797" not in printed and "1.798" not in printed


def test_empty_experiment_and_unknown_experiment(store, tmp_path, capsys):
    uri, _, _ = store
    _client(uri).create_experiment("empty")
    out = tmp_path / "reports"
    assert main(["--experiment", "empty", "--tracking-uri", uri, "--out", str(out), "--name", "e"]) == 0
    page = (out / "e" / "index.html").read_text()
    assert "no pre-training runs to compare" in page
    assert (out / "e" / LOSS_PNG).stat().st_size > 0 and (out / "e" / FEWSHOT_PNG).stat().st_size > 0
    assert main(["--experiment", "nope", "--tracking-uri", uri, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "experiment 'nope' not found" in err and "scaling" in err and "empty" in err
    with pytest.raises(ValueError, match="existing experiments"):
        collect(_client(uri), uri, experiment="nope")
    missing = tmp_path / "absent" / "mlflow.db"
    assert main(["--tracking-uri", f"sqlite:///{missing}", "--out", str(out)]) == 2
    assert "no tracking store" in capsys.readouterr().err and not missing.exists()


def test_the_path_of_the_sqlite_store_is_taken_as_its_uri(store, tmp_path, capsys, monkeypatch):
    """`--tracking-uri mlflow.db`: MLflow reads a plain path as its old ./mlruns folder store and refuses it ("in
    maintenance mode"), which compare passed on with a generic hint. The database's path is its sqlite:/// URI; a
    path where no file is gives the exact URI to pass."""
    uri, _, _ = store
    db = Path(uri.removeprefix("sqlite:///")).resolve()
    monkeypatch.chdir(db.parent)
    for given in (db.name, str(db)):
        argv = ["--experiment", "scaling", "--tracking-uri", given, "--out", str(tmp_path / "r"), "--no-mlflow"]
        assert main(argv) == 0, capsys.readouterr().err
        assert "tiny-run" in capsys.readouterr().out
    assert main(["--tracking-uri", "mlfow.db", "--out", str(tmp_path / "r")]) == 2
    fix = f"--tracking-uri sqlite:///{db.parent / 'mlfow.db'}"
    assert capsys.readouterr().err == (
        "python -m tracking.compare: error: "
        "--tracking-uri mlfow.db is a path, not a tracking URI, and no file is there; "
        f"pass {fix} (an SQLite store) or a server's URL\n"
    )
    assert not (db.parent / "mlfow.db").exists()


def test_a_report_name_of_dots_stays_inside_out(mlflow_uri, tmp_path, capsys):
    """`--name ..` wrote the report into the folder above --out and logged that whole folder to MLflow as its
    artifacts (`--name .`: --out itself). A name is a folder of its own under --out."""
    _log_run(mlflow_uri, "dots", "tiny", model="vit_s16", recipe="r", steps=2, gflops=1)
    out = tmp_path / "reports"
    (tmp_path / "secret.txt").write_text("mine")
    for name, folder in (("..", "comparison"), (".", "comparison"), ("../up", "up")):
        assert main(["--experiment", "dots", "--tracking-uri", mlflow_uri, "--out", str(out), "--name", name]) == 0
        assert f"report: {out / folder / 'index.html'}\n" in capsys.readouterr().out
    assert not (tmp_path / "index.html").exists() and not (tmp_path / "up").exists()  # nothing above --out
    assert sorted(p.name for p in out.iterdir()) == ["comparison", "up"]
    client = _client(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("dots").experiment_id], f"tags.{keys.KIND} = 'comparison'")
    artifacts = {a.path for r in runs for a in client.list_artifacts(r.info.run_id, "report")}
    assert len(runs) == 3 and "report/index.html" in artifacts and "report/secret.txt" not in artifacts


def test_a_database_uri_without_its_driver_is_one_line(tmp_path, capsys):
    """`--tracking-uri postgresql://...` without psycopg installed: a ModuleNotFoundError traceback, exit 1."""
    uri = "postgresql://user@127.0.0.1:1/mlflow"
    assert main(["--tracking-uri", uri, "--out", str(tmp_path / "r"), "--no-mlflow"]) == 2
    assert capsys.readouterr().err == (
        f"python -m tracking.compare: error: cannot read the tracking store {uri}: its database driver is not "
        "installed (No module named 'psycopg'); install the driver SQLAlchemy names for it into .venv, or pass the "
        "URL of an MLflow server\n"
    )
    assert not (tmp_path / "r").exists()


def test_a_report_folder_that_is_a_file_is_one_line(mlflow_uri, tmp_path, capsys):
    """`<out>/<name>` a file (--out itself was checked, not the report's folder in it): a FileExistsError traceback,
    exit 1, after the whole store was read."""
    out = tmp_path / "reports"
    out.mkdir()
    (out / "all").write_text("notes")
    assert main(["--tracking-uri", mlflow_uri, "--out", str(out), "--no-mlflow"]) == 2
    assert capsys.readouterr().err == (
        "python -m tracking.compare: error: "
        f"the report folder {out / 'all'} is a file; pass another --name, or another --out\n"
    )
    assert (out / "all").read_text() == "notes"


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys):
    """Ctrl-C while the tracking server is slow to answer: a traceback of whatever it interrupted, killed by the
    signal. A server that takes Ctrl-C's place: the command's main thread gets SIGINT when its first request comes."""
    import http.server
    import signal
    import threading

    main_thread = threading.main_thread().ident

    class CtrlC(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            signal.pthread_kill(main_thread, signal.SIGINT)  # as a terminal's Ctrl-C, while the command waits

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CtrlC)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as in a terminal
    try:
        code = main(["--tracking-uri", f"http://127.0.0.1:{server.server_port}", "--out", str(tmp_path / "r")])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped tracking.compare's main() as a traceback")
    finally:
        signal.signal(signal.SIGINT, previous)
        server.shutdown()
        server.server_close()
    assert code == 130
    assert (
        capsys.readouterr().err
        == "python -m tracking.compare: interrupted; no report is written; the same command starts over\n"
    )
    assert not (tmp_path / "r").exists()


CHECK_SCRIPT = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  const out = document.createElement("pre");
  out.id = "image-check";
  out.textContent = "IMAGES " + imgs.length + " LOADED " + imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.appendChild(out);
});
</script>"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("Chromium is not installed: `apt-get install chromium` (Debian), as .ci/run and the README do")


def _chromium_run(args, user_data_dir: Path) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--hide-scrollbars",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--mute-audio",
        f"--user-data-dir={user_data_dir}",
        "--virtual-time-budget=5000",
    ]
    return subprocess.run([_chromium(), *flags, *args], capture_output=True, text=True, timeout=120)


def test_report_renders_in_headless_chromium(two_run_report, tmp_path):
    # A copy of the page with a checker script, next to the original so the relative image links resolve.
    page = (two_run_report / "index.html").read_text()
    check = two_run_report / "_image_check.html"
    check.write_text(page.replace("</body>", CHECK_SCRIPT + "</body>"))
    dom = _chromium_run(["--dump-dom", check.as_uri()], tmp_path / "profile-dom")
    check.unlink()
    assert "IMAGES 2 LOADED 2" in dom.stdout, dom.stderr[-2000:]

    shot = tmp_path / "report.png"
    result = _chromium_run(
        [f"--screenshot={shot}", "--window-size=1280,2000", (two_run_report / "index.html").as_uri()],
        tmp_path / "profile-shot",
    )
    assert shot.is_file(), result.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    assert pixels.shape[:2] == (2000, 1280)
    # Not blank: plenty of non-white pixels, several colours (lines of both runs, table stripes, text).
    non_white = (pixels.min(axis=2) < 200).mean()
    assert 0.01 < non_white < 0.6, non_white
    assert len(np.unique(pixels.reshape(-1, 3)[::7], axis=0)) > 50
    # The figures are below the table: the lower half of the page must carry drawn content too.
    assert (pixels[1000:].min(axis=2) < 200).mean() > 0.005


def test_default_compares_every_experiment_but_never_comparison_runs(store, two_run_report):
    uri, _, _ = store
    comparison = collect(_client(uri), uri)
    names = {r.run_name for r in comparison.runs}
    assert {"b16-run", "tiny-run"} <= names
    assert not any(name.startswith("compare-") for name in names)  # the report run logged by two_run_report
    assert comparison.title == "all experiments"


@pytest.mark.timeout(60)
def test_a_server_that_does_not_answer_is_one_line_in_seconds(tmp_path, capsys, monkeypatch):
    """Nothing listening at the URL: MLflow's own retries kept the command silent for ~274 s, and its error then
    suggested passing a server URL, which the user had. The server is asked first, briefly."""
    import time

    from cluster.local_head import free_port

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)  # MLflow's default retries, as a user has
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["--tracking-uri", uri, "--out", str(tmp_path / "reports")]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 20
    assert (
        err.startswith(f"python -m tracking.compare: error: no MLflow server answers at {uri} (")
        and err.count("\n") == 1
    )
    assert err.endswith("; start it or fix --tracking-uri\n") and not (tmp_path / "reports").exists()


def test_comparison_runs_do_not_crowd_out_the_runs_compared(store, monkeypatch):
    """Each `make compare` adds a comparison run to the experiment. The newest MAX_RUNS + 1 runs were read and the
    comparison runs dropped after: newer comparison runs pushed training runs out of the report, without the note
    that runs were left out (here, every training run)."""
    from tracking import report_collect

    uri, _, _ = store
    monkeypatch.setattr(report_collect, "MAX_RUNS", 2)
    trained = [create_run(uri, "crowded", f"train-{n}", {}, run_tags("r", "vit_s16", 2)) for n in range(3)]
    for n in range(3):
        create_run(uri, "crowded", f"compare-{n}", {}, {keys.KIND: report_collect.COMPARISON_KIND})
    comparison = collect(_client(uri), uri, experiment="crowded")
    assert [r.run_id for r in comparison.runs] == trained[1:]  # the newest two, oldest first
    assert comparison.notes == ("only the newest 2 runs are shown; select runs with --runs or --experiment",)


@pytest.mark.timeout(90)
def test_a_server_whose_calls_fail_is_one_line_in_seconds(tmp_path, capsys, monkeypatch):
    """A server that answers /health while every call fails (its database down: MLflow answers 500): MLflow's own
    retries of each call kept the command silent for ~250 s, and its error then suggested another --tracking-uri.
    One call is tried first, without retries."""
    import http.server
    import threading
    import time

    class DatabaseDown(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith("/health"):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"OK")
                return
            body = b'{"error_code": "INTERNAL_ERROR", "message": "(sqlite3.OperationalError) unable to open database"}'
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)  # MLflow's default retries, as a user has
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DatabaseDown)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_port}"
    started = time.monotonic()
    try:
        assert main(["--tracking-uri", uri, "--out", str(tmp_path / "reports")]) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert err.startswith(f"python -m tracking.compare: error: the MLflow server at {uri} answers /health but ")
    assert "HTTP 500" in err and "unable to open database" in err and err.count("\n") == 1
    assert not (tmp_path / "reports").exists()


def test_the_report_goes_under_the_project_from_any_folder(store, tmp_path, monkeypatch):
    """As the store is found: `python -m tracking.compare` from a sub-folder wrote `<sub-folder>/reports/`."""
    uri, _, _ = store
    name = f"from-elsewhere-{os.getpid()}"
    monkeypatch.chdir(tmp_path)
    reports = PROJECT_ROOT / "reports"
    made = not reports.exists()
    try:
        assert main(["--experiment", "scaling", "--tracking-uri", uri, "--name", name, "--no-mlflow"]) == 0
        assert (reports / name / "index.html").is_file() and not (tmp_path / "reports").exists()
    finally:
        shutil.rmtree(reports / name, ignore_errors=True)
        if made and not any(reports.iterdir()):
            reports.rmdir()


def test_a_run_repeated_in_runs_is_compared_once(store, tmp_path, capsys):
    """`--runs R,R` reported the run twice ("Comparison report of 2 runs", two rows)."""
    uri, _, runs = store
    run_id = runs["ti"][0]
    out = tmp_path / "reports"
    assert main(["--runs", f"{run_id},{run_id}", "--tracking-uri", uri, "--out", str(out), "--no-mlflow"]) == 0
    with open(next(out.glob(f"*/{CSV_NAME}")), newline="") as f:
        assert [row["run_id"] for row in csv.DictReader(f)] == [run_id]
    assert [r.run_id for r in collect(_client(uri), uri, run_ids=(run_id, run_id)).runs] == [run_id]


def test_a_comparison_run_passed_as_a_run_to_compare_is_one_line(store, tmp_path, capsys):
    """A comparison report's run id in --runs said "no pre-training runs to compare: launch one" and exited 0."""
    uri, _, runs = store
    tags = {keys.KIND: "comparison", keys.COMPARED_RUNS: runs["ti"][0]}
    report = create_run(uri, "comparisons", "compare-x", {}, tags)
    assert main(["--runs", report, "--tracking-uri", uri, "--out", str(tmp_path / "reports")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m tracking.compare: error: run {report} is a comparison report")
    assert err.count("\n") == 1 and not (tmp_path / "reports").exists()
    assert f"not a pre-training run; pass the runs it compares ({runs['ti'][0]})" in err


def test_the_means_of_named_suite_entries_are_noted(mlflow_uri):
    """Evals logged under an entry `name:` (`ci_probe/mean`, the documented way to run vtab1k_probe beside vtab1k)
    showed as "—" in the columns, without a word."""
    run_id, _ = _log_run(mlflow_uri, "named", "named-run", model="vit_s16", recipe="r", steps=4, gflops=1)
    with Tracker(mlflow_uri, run_id, rank=0) as tracker:
        tracker.log_metrics({"ci_probe/mean": 0.25, "ci_probe/natural": 0.5, "fewshot_small/mean/10shot": 0.125}, 4)
    [run] = collect(_client(mlflow_uri), mlflow_uri, experiment="named").runs
    assert run.vtab_mean is None and run.fewshot_10shot is None  # the columns keep the unnamed entries' keys
    assert (
        "named suite entries' means: ci_probe/mean 0.2500, fewshot_small/mean/10shot 0.1250; the columns show the "
        "unnamed entries' (fewshot/, finetune/, vtab/)"
    ) in run.notes


def test_a_run_whose_every_eval_failed_is_not_called_unevaluated(mlflow_uri):
    """Its checkpoints were evaluated, and every eval failed: the note said "no checkpoint evaluated yet"."""
    run_id = create_run(mlflow_uri, "failing-evals", "r", {}, run_tags("local_demo", "vit_tiny_debug", 2))
    client = _client(mlflow_uri)
    client.log_metric(run_id, keys.LOSS, 2.0, step=30)
    for step in (0, 30):
        client.log_metric(run_id, keys.eval_failed("local_fewshot"), 1.0, step=step)
    unevaluated = create_run(mlflow_uri, "failing-evals", "u", {}, run_tags("local_demo", "vit_tiny_debug", 2))
    client.log_metric(unevaluated, keys.LOSS, 2.0, step=30)
    run, later = collect(client, mlflow_uri, run_ids=(run_id, unevaluated)).runs
    said = "no eval metrics logged (every eval failed: eval_failed/local_fewshot; see the run's eval_failures/)"
    assert said in run.notes, run.notes
    assert "no eval metrics logged (no checkpoint evaluated yet)" in later.notes, later.notes
