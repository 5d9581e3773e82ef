"""Every `python -m` entry point on bad input: exit status 2, one message that names the problem, no traceback.

One table of broken and mis-shaped YAML (recipes, cluster profiles, eval suites), bad `--set` overrides, missing or
damaged files and folders, unknown names, bad flags, and Ray clusters that are not there. Each row lists regular
expressions its stderr must match: the file (and line) or the field at fault; its last line starts
`python -m <module>: error: `, as argparse's own errors do. Each row runs in its own process, as
`python -m` runs it, forked two at a time from one interpreter that imported torch and the other heavy libraries
once (tests/support/warm_python.py): importing torch in every process was most of the table's cost. Two rows also run as
plain `python -m` processes and must give the same status and stderr.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cluster.local_head import free_port

ROOT = Path(__file__).resolve().parents[2]


def _bad_inputs(tmp: Path) -> dict[str, str]:
    """Write every bad input the table refers to; returns the placeholders its arguments use."""
    files = {
        "recipe_syntax.yaml": "model: [unclosed\n",
        "recipe_list.yaml": "- model\n- data\n",
        "recipe_keys.yaml": "model:\n  name: vit_s16\n  1: x\n  bogus: 2\n",
        "profile_syntax.yaml": "name: x\nhardware: [unclosed\n",
        "suite_syntax.yaml": "name: x\nevaluators:\n  - type: fewshot\n    shots: [1, 5\n",
        "suite_shape.yaml": "evaluators:\n  - type: [fewshot]\n",
        "suite_option.yaml": "name: x\nevaluators:\n  - type: fewshot\n    shot: [1, 5]\n",  # a typo of shots
        "suite_value.yaml": "name: x\nevaluators:\n  - type: fewshot\n    shots: [0, 5]\n",
        "plan_notjson.json": "{not json",
        "afile": "a file where a folder is expected\n",
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    local = (ROOT / "cluster/profiles/local.yaml").read_text()
    (tmp / "profile_types.yaml").write_text(local.replace("num_workers: 2", "num_workers: two"))
    # A local profile whose Ray temp dir holds no head: `cluster.jobs` must say how to start one, not start it.
    (tmp / "profile_nohead.yaml").write_text(re.sub(r"temp_dir: .*", f"temp_dir: {tmp / 'ray-none'}", local))
    # ... and one whose head.json outlived its head (killed, rebooted): `cluster.env` must not point the CLI at it.
    (tmp / "ray-stale").mkdir()
    (tmp / "ray-stale" / "head.json").write_text(
        f'{{"gcs_address": "127.0.0.1:{free_port()}", "dashboard_url": "http://127.0.0.1:{free_port()}", '
        f'"temp_dir": "{tmp / "ray-stale"}", "auth_mode": "token", "started_by_us": true}}'
    )
    (tmp / "profile_stalehead.yaml").write_text(re.sub(r"temp_dir: .*", f"temp_dir: {tmp / 'ray-stale'}", local))
    remote = (ROOT / "cluster/profiles/a100x8.yaml").read_text()
    address = f"http://127.0.0.1:{free_port()}"
    (tmp / "profile_remote.yaml").write_text(re.sub(r"address: .*", f'address: "{address}"', remote, count=1))
    (tmp / "garbage.npz").write_bytes(b"garbage, not a zip archive")
    buffer = io.BytesIO()
    np.savez(buffer, **{"embedding/kernel": np.zeros((16, 16, 3, 8), np.float32)})
    (tmp / "truncated.npz").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (tmp / "weights.pkl").write_bytes(pickle.dumps({"state_dict": [1, 2, 3]}))
    (tmp / "notshards").mkdir()
    damaged = tmp / "shards_badjson"
    damaged.mkdir()
    (damaged / "dataset.json").write_text("{truncated")
    (damaged / "manifest.parquet").write_bytes(b"PAR1 not parquet")
    incomplete = tmp / "step_00000010"  # a checkpoint whose save never finished: no COMPLETE marker
    incomplete.mkdir()
    (incomplete / "trainer_state.json").write_text('{"step": 10}')
    (tmp / "src" / "cat").mkdir(parents=True)
    (tmp / "run_badcourier").mkdir()
    (tmp / "run_badcourier" / "mlflow_courier.json").write_text("{truncated")  # a job's end cut short
    (tmp / "run_keyless").mkdir()
    (tmp / "run_keyless" / "mlflow_courier.json").write_text('{"status": "FINISHED"}')  # a KeyError traceback before
    return {"tmp": str(tmp), "missing": str(tmp / "nothere"), "incomplete": str(incomplete)} | {
        Path(name).stem: str(tmp / name)
        for name in [*files, "profile_types.yaml", "profile_nohead.yaml", "profile_stalehead.yaml"]
        + ["profile_remote.yaml", "garbage.npz"]
        + ["truncated.npz", "weights.pkl", "notshards", "shards_badjson", "run_badcourier", "run_keyless"]
    }


# (module, arguments with {placeholders}, regular expressions stderr must match)
TABLE: list[tuple[str, list[str], list[str]]] = [
    # pretrain.train: the recipe file, its shape and keys, --set overrides, the files the config points at
    ("pretrain.train", ["--config", "{recipe_syntax}", "--dry-run"], [r"recipe_syntax\.yaml, line \d", r"line 1\b"]),
    ("pretrain.train", ["--config", "{recipe_keys}", "--dry-run"], [r"recipe_keys\.yaml", r"model\.bogus"]),
    ("pretrain.train", ["--config", "local_demo", "--set", "optim.lr", "--dry-run"], [r"optim\.lr", r"key=value"]),
    ("pretrain.train", ["--config", "local_demo", "--set", "optim.lr=[1,", "--dry-run"], [r"optim\.lr", r"YAML"]),
    ("pretrain.train", ["--config", "local_demo", "--set", "optim.lr=fast", "--dry-run"], [r"optim\.lr.*number"]),
    ("pretrain.train", ["--config", "local_demo", "--summary", "s{{node}}.json", "--dry-run"], [r"only \{rank\} may"]),
    (
        "pretrain.train",
        ["--config", "local_demo", "--summary", "/proc/s.json", "--dry-run"],
        [r"cannot write in /proc"],
    ),
    (
        "pretrain.train",
        ["--config", "local_demo", "--set", "checkpoint.init_from={garbage}", "--dry-run"],
        [r"checkpoint\.init_from", r"garbage\.npz"],
    ),
    (
        "pretrain.train",
        ["--config", "local_demo", "--set", "checkpoint.dir=gs://bucket/runs/r", "--dry-run"],
        [r"checkpoint\.dir='gs://bucket/runs/r' is object storage", r"filesystem path"],
    ),
    (
        "pretrain.train",
        ["--config", "local_demo", "--set", "data.builtin=null", "--set", "data.train={notshards}", "--dry-run"],
        [r"data\.train", r"manifest\.parquet"],
    ),
    # python -m pretrain.weights: not weights at all, cut short, absent, a checkpoint whose save did not finish
    ("pretrain.weights", ["info", "{weights}"], [r"weights\.pkl"]),
    ("pretrain.weights", ["info", "{truncated}"], [r"truncated\.npz"]),
    ("pretrain.weights", ["info", "{missing}"], [r"nothere"]),
    ("pretrain.weights", ["info", "{incomplete}"], [r"COMPLETE"]),
    ("pretrain.weights", ["export", "{missing}", "gs://bucket/hf"], [r"OUT gs://bucket/hf: object storage"]),
    # data_pipeline
    ("data_pipeline.builtin", ["digits", "--out", "{afile}"], [r"--out", r"afile"]),
    ("data_pipeline.builtin", ["digits", "--out", "{tmp}/data", "--set", "resolution=abc"], [r"resolution"]),
    ("data_pipeline.builtin", ["digits", "--out", "{tmp}/data", "--set", "bogus=1"], [r"no field 'bogus'; fields: "]),
    ("data_pipeline.validate", ["{notshards}"], [r"notshards", r"dataset\.json"]),
    ("data_pipeline.validate", ["{shards_badjson}"], [r"shards_badjson", r"dataset\.json"]),
    ("data_pipeline.write", ["--source", "{missing}", "--out", "{tmp}/w"], [r"--source", r"nothere"]),
    ("data_pipeline.write", ["--source", "{tmp}/src", "--out", "s3://b/w"], [r"--out s3://b/w: object storage"]),
    (
        "data_pipeline.write",
        ["--source", "{tmp}/src", "--out", "{tmp}/w", "--class-names", "{missing}"],
        [r"--class-names", r"nothere"],
    ),
    (
        "data_pipeline.write",
        ["--source", "{tmp}/src", "--out", "{tmp}/w", "--class-names", "{weights}"],
        [r"class-name file \S+weights\.pkl is not UTF-8 text \(byte 0\)"],
    ),
    ("data_pipeline.write", ["--source", "{notshards}", "--kind", "parquet", "--out", "{tmp}/w"], [r"no \.parquet"]),
    (
        "data_pipeline.write",
        ["--source", "{tmp}/src", "--out", "{tmp}/w", "--max-short-side", "10", "--min-size", "20"],
        [r"--max-short-side 10 is below --min-size 20"],
    ),
    (
        "data_pipeline.write",
        ["--source", "{tmp}/src", "--out", "{tmp}/w", "--exclude-like", "{notshards}"],
        [r"--exclude-like \S+notshards holds no images and no samples\.parquet"],
    ),
    # evals: suites (a suite is read before any weights), weights, tracking stores, the UI's flags
    ("evals.run", ["--checkpoint", "{incomplete}", "--suite", "{suite_syntax}"], [r"suite_syntax\.yaml, line \d"]),
    ("evals.run", ["--checkpoint", "{incomplete}", "--suite", "{suite_shape}"], [r"suite_shape\.yaml", r"type"]),
    ("evals.run", ["--checkpoint", "{incomplete}", "--suite", "{suite_value}"], [r"suite_value\.yaml", r"shots must"]),
    ("evals.run", ["--checkpoint", "{incomplete}", "--suite", "local_fewshot"], [r"COMPLETE"]),
    (
        "evals.run",
        ["--checkpoint", "{incomplete}", "--suite", "local_fewshot", "--out", "gs://b/ev"],
        [r"--out gs://b/ev: object storage"],
    ),
    ("tracking.compare", ["--tracking-uri", "sqlite:///{tmp}/none.db", "--no-mlflow"], [r"none\.db"]),
    ("tracking.compare", ["--tracking-uri", "foo://bar", "--no-mlflow", "--out", "{tmp}/rep"], [r"foo://bar"]),
    ("tracking.ui", ["--port", "70000", "--dry-run"], [r"--port 70000"]),
    ("tracking.ui", ["--workers", "0", "--dry-run"], [r"--workers"]),
    # the rest: checkpoint checks, the elastic demo, the GPU campaign and its calibration, the precision bench
    ("pretrain.checkpoint", ["verify", "{missing}"], [r"nothere does not exist"]),
    ("pretrain.checkpoint", ["verify", "gs://b/runs/r"], [r"gs://b/runs/r is object storage"]),
    ("cluster.elastic_demo", ["--steps", "-3"], [r"--steps -3"]),
    ("cluster.calibrate", ["{missing}"], [r"nothere", r"bench\.gpu"]),
    ("cluster.driver.deliver", ["{missing}"], [r"nothere is not a folder", r"checkpoint\.dir"]),
    ("cluster.driver.deliver", ["{tmp}", "--wait", "0"], [r"--wait 0: give a positive number"]),
    ("cluster.driver.deliver", ["{run_badcourier}"], [r"mlflow_courier\.json cannot be read", r"delete it only"]),
    ("cluster.elastic_demo", ["--out", "/proc/vitscale-demo"], [r"--out /proc/vitscale-demo: cannot create it"]),
    ("cluster.driver.deliver", ["{run_keyless}"], [r"courier\.json lacks tracking_uri, run, evals", r"delete it only"]),
    ("bench.precision", ["--trials", "0"], [r"--trials 0"]),
    ("bench.gpu", ["--budget-s", "-1"], [r"--budget-s"]),
    ("bench.gpu", ["--smoke", "--parts", "step,nope"], [r"--parts", r"'nope'\] is not one of data, step"]),
    ("bench.gpu", ["--smoke", "--models", ","], [r"--models", r"',' names nothing; choose from vit_h14"]),
    ("bench.gpu", ["--smoke", "--train-set", "model.compile"], [r"--train-set 'model\.compile' is not KEY=VALUE"]),
    # the train part's keys are H/14's: another model's numbers were filed as H/14's calibration
    ("bench.gpu", ["--smoke", "--train-set", "model.name=vit_ti16"], [r"leave model\.name as it is"]),
    ("bench.gpu", ["--budget-s", "nan"], [r"--budget-s and --peak-tflops must be > 0"]),
    ("bench.gpu.train", ["{missing}", "{tmp}/o.json"], [r"SPEC\.json \S+nothere"]),
    # cluster: profiles (syntax, types, unknown), the recipe's eval suite, flags, absent clusters, job specs
    ("cluster.launch", ["--cluster", "{profile_syntax}", "--dry-run"], [r"profile_syntax\.yaml, line \d"]),
    ("cluster.launch", ["--cluster", "{profile_types}", "--dry-run"], [r"profile_types\.yaml", r"num_workers"]),
    (
        "cluster.launch",
        ["--recipe", "local_demo", "--set", "evals.suite={suite_syntax}", "--dry-run"],
        [r"suite_syntax\.yaml, line \d"],
    ),
    (  # a suite's options are checked before anything is submitted, not after the first checkpoint
        "cluster.launch",
        ["--recipe", "local_demo", "--set", "evals.suite={suite_option}", "--dry-run"],
        [r"suite_option\.yaml", r"unknown key.*shot"],
    ),
    ("cluster.launch", ["--run-name", "../elsewhere", "--dry-run"], [r"run name '\.\./elsewhere'", r"--run-name"]),
    ("cluster.launch", ["--inject-worker-failure", "1", "--dry-run"], [r"'1'; write RANK:STEP\[:DELAY_S\]"]),
    ("cluster.render", ["--cluster", "local", "--out", "{tmp}/rendered"], [r"profile local", r"GPU profile"]),
    ("cluster.render", ["--cluster", "a100x8", "--out", "{afile}/sub"], [r"--out", r"afile"]),
    ("cluster.jobs", ["status", "--cluster", "{profile_nohead}"], [r"no Ray head", r"make launch"]),
    ("cluster.jobs", ["logs", "--cluster", "{profile_remote}"], [r"cannot reach", r"ray up"]),
    ("cluster.jobs", ["status", "--cluster", "no_such_profile"], [r"no_such_profile", r"a100x8"]),
    ("cluster.jobs", ["status", "--cluster", "{recipe_list}"], [r"recipe_list\.yaml", r"mapping"]),
    # cluster.env (`make env`): exports for Ray's own CLI need a head that runs
    ("cluster.env", ["--cluster", "{profile_nohead}"], [r"no Ray head", r"make launch"]),
    ("cluster.env", ["--cluster", "{profile_stalehead}"], [r"does not answer at http://127\.0\.0\.1", r"make launch"]),
    ("cluster.driver", ["--plan", "{missing}"], [r"nothere"]),
    ("cluster.driver", ["--cluster", "no_such_profile", "--recipe", "local_demo"], [r"no_such_profile", r"a100x8"]),
    ("cluster.driver", ["--recipe", "local_demo"], [r"--recipe needs --cluster"]),
    (  # the run folder stays under the profile's checkpoints, whichever entry point plans
        "cluster.driver",
        ["--cluster", "local", "--run-name", "../elsewhere", "--dry-run"],
        [r"run name '\.\./elsewhere': use letters"],
    ),
    ("cluster.preflight", ["--cluster", "no_such_profile"], [r"no_such_profile", r"a100x8"]),
    ("cluster.preflight", ["--cluster", "local", "--recipe", "no_such_recipe"], [r"no_such_recipe"]),
    ("cluster.driver", ["--plan", "{plan_notjson}"], [r"plan_notjson\.json", r"line 1"]),
    ("cluster.driver", ["--plan", "{recipe_list}"], [r"recipe_list\.yaml", r"job spec"]),
    # bench: numbers that measure nothing, an output path that cannot be written (found before the timing)
    ("bench.data", ["--images", "0"], [r"--images 0"]),
    ("bench.data", ["--loader-copies", "0"], [r"--loader-copies 0: must be >= 1"]),
    ("bench.data", ["--loader-rounds", "0"], [r"--loader-rounds 0: must be >= 1"]),
    ("bench.train", ["--out", "{tmp}"], [r"--out", r"folder"]),
    ("bench.scale", ["--out", "{tmp}"], [r"--out", r"folder"]),
    ("bench.scaling", ["--global-batch", "15"], [r"--global-batch 15"]),
]


def _run(module: str, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _run_warm(rows: list, env: dict[str, str], cwd: Path, tmp: Path) -> list[subprocess.CompletedProcess]:
    """Every row as ``python -m module args``, forked from one warm interpreter (tests/support/warm_python.py)."""
    requests = [
        {"module": module, "args": args, "stdout": str(tmp / f"{i}.out"), "stderr": str(tmp / f"{i}.err")}
        for i, (module, args, _) in enumerate(rows)
    ]
    (tmp / "requests.json").write_text(json.dumps(requests))
    server = [
        sys.executable,
        str(ROOT / "tests/support/warm_python.py"),
        str(tmp / "requests.json"),
        str(tmp / "results.json"),
    ]
    done = subprocess.run([*server, "--jobs", "2"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = json.loads((tmp / "results.json").read_text())
    return [
        subprocess.CompletedProcess(
            [module, *args], status, Path(r["stdout"]).read_text(), Path(r["stderr"]).read_text()
        )
        for (module, args, _), r, status in zip(rows, requests, statuses, strict=True)
    ]


@pytest.mark.slow
def _entry_points() -> set[str]:
    """Every module of the six packages that runs as `python -m` (a ``__main__`` block; a package by its name)."""
    found = set()
    for package in ("pretrain", "data_pipeline", "evals", "cluster", "tracking", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            if 'if __name__ == "__main__"' in path.read_text(encoding="utf-8"):
                parts = path.relative_to(ROOT).with_suffix("").parts
                found.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


@pytest.mark.timeout(900)
def test_every_entry_point_rejects_bad_input_with_one_message(tmp_path):
    assert len(TABLE) >= 30 and {m for m, _, _ in TABLE} == _entry_points()  # every `python -m` entry point
    values = _bad_inputs(tmp_path)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"  # never the project's own store
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    work = tmp_path / "cwd"  # relative default outputs (rendered/, reports/) land here, not in the project
    work.mkdir()
    rows = [(module, [a.format(**values) for a in args], patterns) for module, args, patterns in TABLE]
    (tmp_path / "warm").mkdir()
    results = _run_warm(rows, env, work, tmp_path / "warm")
    # The warm forks behave as `python -m` does: a row that imports torch and one that does not, run both ways.
    for i in (0, next(i for i, row in enumerate(rows) if row[0] == "cluster.jobs")):
        cold = _run(rows[i][0], rows[i][1], env, work)
        assert (cold.returncode, cold.stderr) == (results[i].returncode, results[i].stderr), (cold, results[i])
    failures = []
    for (module, args, patterns), done in zip(rows, results, strict=True):
        problems = []
        if done.returncode != 2:
            problems.append(f"exit status {done.returncode}, not 2")
        if "Traceback" in done.stdout + done.stderr:
            problems.append("a traceback")
        if "error" not in done.stderr:
            problems.append("no 'error' message on stderr")
        prefix = f"python -m {module}: error: "  # argparse's own form: one prefix for every entry point
        if not (done.stderr.rstrip().splitlines() or [""])[-1].startswith(prefix):
            problems.append(f"the last line of stderr does not start with {prefix!r}")
        problems += [f"stderr does not match {p!r}" for p in patterns if not re.search(p, done.stderr)]
        if problems:
            output = (done.stderr.strip() or done.stdout.strip())[-1500:]
            failures.append(f"python -m {module} {' '.join(args)}: {'; '.join(problems)}\n    {output}")
    assert not failures, f"{len(failures)} of {len(rows)} bad inputs mishandled:\n" + "\n".join(failures)
