"""The goodput ledger in `make compare`: runs logged to a real MLflow SQLite store, read back, tabled and drawn."""

import csv
import re
import time

import numpy as np
import pytest
from PIL import Image

from tracking import keys
from tracking.compare import main
from tracking.report_collect import collect
from tracking.report_goodput import (
    BUCKET_COLORS,
    GOODPUT_PNG,
    Goodput,
    bucket_color,
    draw_goodput,
    goodput_line,
    read_goodput,
)
from tracking.report_render import CSV_NAME, format_table

pytestmark = pytest.mark.timeout(120)

# The final ledgers (seconds per bucket; the rest 0): each sums to its wall-clock, as the ledger guarantees.
STEADY = {"productive": 800.0, "data_wait": 100.0, "checkpoint": 50.0, "startup": 40.0, "other": 10.0}
RESTARTED = {"productive": 300.0, "restart": 150.0, "startup": 30.0, "data_wait": 20.0}
STEP_TAILS = {50: 0.12, 90: 0.15, 99: 0.4}
WAIT_TAILS = {50: 0.001, 90: 0.002, 99: 0.25}


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _ledger_metrics(seconds: dict, log_fraction: bool = True) -> dict:
    wall = sum(seconds.values())
    metrics = {keys.goodput_bucket(b): seconds.get(b, 0.0) for b in keys.GOODPUT_BUCKETS}
    metrics[keys.GOODPUT_WALL_S] = wall
    if log_fraction:
        metrics[keys.GOODPUT_FRACTION] = seconds["productive"] / wall
    return metrics


def _log(client, experiment_id, name, by_step: dict[int, dict]) -> str:
    """One run with these metrics at these steps, logged by MLflow's client directly; returns its id."""
    from mlflow.entities import Metric

    run_id = client.create_run(experiment_id, run_name=name).info.run_id
    now = int(time.time() * 1000)
    batch = [Metric(k, v, now + step, step) for step, metrics in by_step.items() for k, v in metrics.items()]
    client.log_batch(run_id, metrics=batch)
    client.set_terminated(run_id, status="FINISHED")
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = _client(uri)
    experiment = client.create_experiment("ledger", artifact_location=(root / "artifacts").as_uri())
    train = {keys.LOSS: 2.0, keys.IMAGES_SEEN: 640.0}
    tails = {
        **{keys.step_time_percentile(p): v for p, v in STEP_TAILS.items()},
        **{keys.data_wait_percentile(p): v for p, v in WAIT_TAILS.items()},
    }
    # Logged over time: an early ledger at step 10, the final one at the job's last step (the report reads that).
    early = _ledger_metrics({"productive": 90.0, "startup": 40.0, "data_wait": 10.0})
    _log(client, experiment, "steady", {10: {**train, **early}, 20: {**train, **tails, **_ledger_metrics(STEADY)}})
    _log(client, experiment, "restarted", {20: {**train, **_ledger_metrics(RESTARTED, log_fraction=False)}})
    _log(client, experiment, "old", {10: train, 20: train})  # a run from before the ledger
    old_only = client.create_experiment("before-ledger", artifact_location=(root / "artifacts-old").as_uri())
    _log(client, old_only, "old-a", {5: train})
    return uri, root


def _table_cells(page: str, column: str) -> dict[str, str]:
    """{run name: text of ``column``} from the first table of the page (the runs table)."""
    table = page.split("<table>", 1)[1].split("</table>", 1)[0]
    heads = [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<th[^>]*>(.*?)</th>", table)]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    return {row[0]: row[heads.index(column)] for row in rows}


def test_collect_reads_the_latest_ledger_and_none_without_one(store):
    uri, _ = store
    runs = {r.run_name: r for r in collect(_client(uri), uri, experiment="ledger").runs}
    steady = runs["steady"].goodput
    assert dict(steady.seconds) == {b: STEADY.get(b, 0.0) for b in keys.GOODPUT_BUCKETS}  # step 20, not step 10
    assert (steady.wall_s, steady.fraction) == (1000.0, pytest.approx(0.8))
    assert steady.share("data_wait") == pytest.approx(0.1)
    assert runs["steady"].step_tails == tuple(STEP_TAILS.items())
    assert runs["steady"].data_wait_tails == tuple(WAIT_TAILS.items())
    # No goodput/fraction logged: productive / wall-clock.
    assert runs["restarted"].goodput.fraction == pytest.approx(0.6) and runs["restarted"].step_tails == ()
    assert runs["old"].goodput is None and runs["old"].step_tails == () and runs["old"].data_wait_tails == ()


def test_terminal_table_has_the_goodput_column_and_ledger_lines(store):
    uri, _ = store
    table = format_table(collect(_client(uri), uri, experiment="ledger"))
    header, *rows = table.splitlines()[:4]
    column = header.index("Goodput")
    cells = {row.split()[0]: row[column:].split()[0] for row in rows}
    assert cells == {"steady": "80.0%", "restarted": "60.0%", "old": "—"}
    assert (
        "goodput [steady]: 80.0% of 1,000 s wall-clock: productive 800 s (80.0%), data_wait 100 s (10.0%), "
        "checkpoint 50 s (5.0%), startup 40 s (4.0%), other 10 s (1.0%); step time p50 0.12 s, p90 0.15 s, "
        "p99 0.4 s; data wait per step p50 0.001 s, p90 0.002 s, p99 0.25 s"
    ) in table
    assert "goodput [restarted]: 60.0% of 500 s wall-clock: productive 300 s (60.0%)" in table
    assert "goodput [old]" not in table


def test_report_shows_the_ledger_per_run(store):
    uri, root = store
    out = root / "reports"
    assert main(["--experiment", "ledger", "--tracking-uri", uri, "--out", str(out), "--name", "g", "--no-mlflow"]) == 0
    page = (out / "g" / "index.html").read_text()
    assert _table_cells(page, "Goodput") == {"steady": "80.0%", "restarted": "60.0%", "old": "—"}
    # The ledger table under the bar chart: every bucket's share of the wall-clock and its seconds, in key order.
    ledger = page.split('<table class="goodput">', 1)[1].split("</table>", 1)[0]
    heads = re.findall(r"</span>([a-z_]+)</th>", ledger)
    assert heads == list(keys.GOODPUT_BUCKETS)
    steady = re.search(r"<tr><td class=\"text\">steady</td>(.*?)</tr>", ledger).group(1)
    shares = re.findall(r"<td title=\"([a-z_]+): ([0-9.]+) s\">([0-9.]+)%<br>", steady)
    assert [(b, float(s), float(p)) for b, s, p in shares] == [
        (b, STEADY.get(b, 0.0), 100 * STEADY.get(b, 0.0) / 1000) for b in keys.GOODPUT_BUCKETS
    ]
    assert "p99 0.4 s" in steady and "p99 0.25 s" in steady
    assert "restarted" in ledger and '<td class="text">old</td>' not in ledger
    assert "old: no goodput ledger logged" in page
    rows = {r["run_name"]: r for r in csv.DictReader((out / "g" / CSV_NAME).open())}
    assert float(rows["steady"]["goodput_fraction"]) == pytest.approx(0.8)
    assert float(rows["restarted"]["goodput_restart_s"]) == 150.0 and rows["old"]["goodput_wall_s"] == ""
    assert float(rows["steady"]["step_s_p99"]) == 0.4 and rows["restarted"]["step_s_p99"] == ""
    # The PNG's bars: each bucket's colour covers ink in proportion to its share of the wall-clock, summed over both
    # bars: productive 80% + 60%, data wait 10% + 4%, restart 30% (the legend's swatches add one small area to each).
    pixels = np.asarray(Image.open(out / "g" / GOODPUT_PNG).convert("RGB")).reshape(-1, 3)

    def ink(bucket):
        rgb = tuple(int(BUCKET_COLORS[bucket][i : i + 2], 16) for i in (1, 3, 5))
        return int((pixels == rgb).all(axis=1).sum())

    assert ink("productive") / ink("data_wait") == pytest.approx(140 / 14, rel=0.1)
    assert ink("productive") / ink("restart") == pytest.approx(140 / 30, rel=0.1)


def test_bar_segments_are_each_buckets_share_in_key_order(store):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    uri, _ = store
    runs = collect(_client(uri), uri, experiment="ledger").runs
    ax = Figure().subplots()
    notes = draw_goodput(ax, [(r.run_name, r.goodput) for r in runs])
    bars = [p for p in ax.patches if p.get_width() > 0 and p.get_height() == pytest.approx(0.6)]
    by_row: dict[int, list] = {}
    for bar in bars:
        by_row.setdefault(round(bar.get_y() + bar.get_height() / 2), []).append(bar)
    assert sorted(by_row) == [0, 1]  # steady on top, restarted under it; old has no bar
    for row, ledger in ((0, STEADY), (1, RESTARTED)):
        segments = sorted(by_row[row], key=lambda b: b.get_x())
        wall = sum(ledger.values())
        expected = [b for b in keys.GOODPUT_BUCKETS if ledger.get(b)]
        assert [to_hex(s.get_facecolor()) for s in segments] == [bucket_color(b) for b in expected]
        assert [s.get_width() for s in segments] == pytest.approx([100 * ledger[b] / wall for b in expected])
        assert segments[0].get_x() == 0 and segments[-1].get_x() + segments[-1].get_width() == pytest.approx(100)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["steady\n16.7 min · 80.0% goodput", "restarted\n8.3 min · 60.0% goodput"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(keys.GOODPUT_BUCKETS)
    assert notes == ["old: no goodput ledger logged (a run from before it, or one that logged no step)"]


def test_runs_without_a_ledger_render_as_before(store):
    uri, root = store
    out = root / "reports"
    (out / "o").mkdir(parents=True)
    (out / "o" / GOODPUT_PNG).write_bytes(b"stale")  # from an earlier report with ledgers into the same folder
    args = ["--experiment", "before-ledger", "--tracking-uri", uri, "--out", str(out), "--name", "o", "--no-mlflow"]
    assert main(args) == 0
    page = (out / "o" / "index.html").read_text()
    assert _table_cells(page, "Goodput") == {"old-a": "—"}
    assert "Goodput: where" not in page and GOODPUT_PNG not in page and "no goodput ledger" not in page
    assert not (out / "o" / GOODPUT_PNG).exists()
    assert "goodput [" not in format_table(collect(_client(uri), uri, experiment="before-ledger"))


def test_partial_and_inconsistent_ledgers():
    # Buckets only: the wall-clock is their sum and the fraction productive / wall.
    partial = read_goodput({keys.goodput_bucket("productive"): 30.0, keys.goodput_bucket("startup"): 10.0})
    assert (partial.wall_s, partial.fraction, dict(partial.seconds)["restart"]) == (40.0, 0.75, None)
    assert read_goodput({keys.LOSS: 1.0}) is None
    assert read_goodput({keys.GOODPUT_WALL_S: float("nan")}) == Goodput(
        tuple((b, None) for b in keys.GOODPUT_BUCKETS), None, None
    )
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    skewed = read_goodput({**_ledger_metrics(STEADY), keys.GOODPUT_WALL_S: 1200.0})
    empty = read_goodput({keys.GOODPUT_WALL_S: 0.0})
    notes = draw_goodput(Figure().subplots(), [("skewed", skewed), ("empty", empty)])
    assert notes == [
        "skewed: its buckets sum to 1,000 s of 1,200 s wall-clock (values logged at different moments, or time the "
        "ledger missed)",
        "empty: no wall-clock in its goodput ledger yet",
    ]
    assert goodput_line(empty) == "— of 0.0 s wall-clock: no time"


def test_a_relaunch_that_ended_below_the_first_jobs_step_shows_its_own_ledger(store):
    """Each job logs its own ledger at its steps. A relaunch resuming the run from an earlier checkpoint, failed (or
    still running) below the first job's last step, was shown the first job's ledger: MLflow's latest value is the
    highest step's. The newest job's ledger is the run's."""
    from mlflow.entities import Metric

    uri, _ = store
    client = _client(uri)
    experiment = client.create_experiment("relaunched")
    run_id = client.create_run(experiment, run_name="relaunched").info.run_id
    first, second = 1_000_000, 2_000_000  # ms: the relaunch's ledger is the newer one, at lower steps
    monitor = {"productive": 50.0, "startup": 20.0}  # the relaunch's, while it trained
    logged = [(first, 500, STEADY), (second, 420, monitor), (second + 1, 450, RESTARTED)]
    batch = [Metric(keys.LOSS, 2.0, first, 500)]
    for ms, step, seconds in logged:
        batch += [Metric(k, v, ms, step) for k, v in _ledger_metrics(seconds).items()]
    client.log_batch(run_id, metrics=batch)
    [run] = collect(client, uri, experiment="relaunched").runs
    assert dict(run.goodput.seconds) == {b: RESTARTED.get(b, 0.0) for b in keys.GOODPUT_BUCKETS}
    assert (run.goodput.wall_s, run.goodput.fraction) == (500.0, pytest.approx(0.6))
