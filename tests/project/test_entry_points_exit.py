"""Every `python -m` entry point exits cleanly: status 0 and no abort while the interpreter ends.

A CLI once printed its result and then died with "terminate called without an active exception" (SIGABRT, exit
134), about one run in 75 on a loaded machine: a pyarrow pool thread dropped the last reference to bytes read from
a Python file object and took the GIL while the interpreter was ending (docs/reference.md, "Ending a process").
The first test checks that cause directly and deterministically; the second runs each entry point's smallest real
invocation as a real process beside a CPU burner. ``VITSCALE_EXIT_ROUNDS=20`` repeats those runs (the measurement
behind "20 of 20 clean exits"); the suite runs one round.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from pretrain.checkpoint import checksums
from pretrain.checkpoint.run_folder import COMPLETE, TrainerState, checkpoint_dir
from pretrain.model.vit import build_model
from pretrain.weights.formats import save_pretrained
from tests.support.load import cpu_burners

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = int(os.environ.get("VITSCALE_EXIT_ROUNDS", "1"))

pytestmark = pytest.mark.timeout(600 * ROUNDS)  # a measurement of 20 rounds takes about 20 times one


def _threads_after_reading(folder: Path) -> tuple[int, int]:
    """Threads of a fresh process before and after it reads a shard folder's tables the way every CLI does."""
    code = (
        "import os, sys\n"
        "from data_pipeline.manifest import iter_samples, read_dataset_info\n"
        "count = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = count()\n"
        "read_dataset_info(sys.argv[1])\n"
        "for _ in iter_samples(sys.argv[1], ['label']): pass\n"
        "print(before, count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    return int(before), int(after)


def test_reading_a_shard_folder_starts_no_arrow_thread(tiny_fractal_shards):
    """The cause of the abort: an Arrow pool thread holding bytes from a Python file object. Reading the manifest,
    the class names and the sample table on the calling thread starts no pool thread at all."""
    before, after = _threads_after_reading(tiny_fractal_shards)
    assert after == before, f"reading the folder started {after - before} threads (Arrow's pool)"


def _fixtures(tmp: Path) -> None:
    """What the invocations below read: weights, a run folder with one checkpoint, a one-evaluator suite and an
    image folder."""
    model = build_model("vit_tiny_debug", num_classes=3)
    save_pretrained(model, tmp / "saved")
    folder = checkpoint_dir(tmp / "run", 4)
    save_pretrained(model, folder)
    TrainerState(step=4, images_seen=32, world_size=1, deepspeed_tag=folder.name, stream_state={}, rng_states=()).write(
        folder
    )
    files = ("model.safetensors", "model.json", "trainer_state.json")
    checksums.write(folder, {name: checksums.entry(folder / name) for name in files})
    (folder / COMPLETE).write_text("")
    # image_size 16: the eval's 1797 digits through the model at a quarter of its 32 px tokens (1.5 CPU-s less);
    # the invocation still loads the checkpoint, extracts features, fits and writes its table
    (tmp / "suite.yaml").write_text(
        "name: exit_check\nevaluators:\n  - type: fewshot\n    datasets: [digits]\n    shots: [5]\n    seeds: [0]\n"
        "    image_size: 16\n"
    )
    for label in ("cat", "dog"):
        (tmp / "images" / label).mkdir(parents=True)
        for i in range(3):
            colour = (40 * i, 100 if label == "cat" else 200, 30)
            Image.new("RGB", (40, 36), colour).save(tmp / "images" / label / f"{i}.jpg")


def _invocations(tmp: Path, eval_data: Path, out: Path) -> dict[str, list[str] | None]:
    """Each entry point's smallest real invocation, writing under ``out``; None where the smallest real one trains,
    needs a cluster or a GPU campaign's files: those run ``--help`` (their imports and the interpreter's end are what
    can abort), and only when ``VITSCALE_EXIT_ROUNDS`` is set, to keep the suite's CPU for real work."""
    fractal = ["fractal", "--out", str(out / "b"), "--set", "num_classes=8", "--set", "images_per_class=4"]
    evals = ["--checkpoint", str(tmp / "run"), "--suite", str(tmp / "suite.yaml"), "--data-root", str(eval_data)]
    return {
        "data_pipeline.builtin": [*fractal, "--set", "val_per_class=2", "--set", "resolution=32"],
        "data_pipeline.validate": [str(out / "w")],
        "data_pipeline.write": ["--source", str(tmp / "images"), "--out", str(out / "w"), "--samples-per-shard", "4"],
        "pretrain.weights": ["info", str(tmp / "saved")],
        "pretrain.checkpoint": ["verify", str(tmp / "run")],
        "pretrain.train": ["--config", "local_demo", "--dry-run"],
        "evals.run": [*evals, "--out", str(out / "evals")],
        "tracking.ui": ["--dry-run", "--tracking-uri", f"sqlite:///{tmp / 'ui.db'}"],
        "cluster.launch": ["--cluster", "a100x64", "--recipe", "vit_h14_i21k", "--dry-run"],
        "cluster.render": ["--cluster", "a100x64", "--out", str(out / "rendered")],
        "cluster.env": ["--cluster", "a100x64"],
        "cluster.driver.deliver": [str(tmp)],  # a run folder with nothing for MLflow
        **dict.fromkeys(("tracking.compare", "cluster.jobs", "cluster.driver", "cluster.elastic_demo")),
        "cluster.preflight": None,  # needs a Ray cluster: tests/cluster/test_preflight.py runs it on a local head
        **dict.fromkeys(("cluster.calibrate", "bench.train", "bench.gpu.train")),
        **dict.fromkeys(f"bench.{name}" for name in ("data", "gpu", "precision", "scale", "scaling")),
    }


def _entry_points() -> set[str]:
    """Every module of the packages that runs as `python -m` (it has a ``__main__`` guard)."""
    found = set()
    for package in ("pretrain", "data_pipeline", "evals", "tracking", "cluster", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if 'if __name__ == "__main__":' in path.read_text():
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found.add(module.removesuffix(".__main__"))
    return found


@pytest.mark.slow
def test_every_entry_point_exits_cleanly_under_load(tmp_path, eval_data_root):
    _fixtures(tmp_path)
    rounds = [_invocations(tmp_path, eval_data_root, tmp_path / f"round{r}") for r in range(ROUNDS)]
    assert set(rounds[0]) == _entry_points(), "an entry point without a row here, or a row without one"
    env = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")

    def run(command: tuple[str, list[str]]) -> tuple[str, int, str]:
        module, args = command
        proc = subprocess.run(
            [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        return module, proc.returncode, proc.stderr

    measuring = "VITSCALE_EXIT_ROUNDS" in os.environ
    writes = [("data_pipeline.write", r.pop("data_pipeline.write")) for r in rounds]  # validate reads what it wrote
    others = [[(m, args or ["--help"]) for m, args in r.items() if measuring or args is not None] for r in rounds]
    results = []
    with cpu_burners(1, measuring):  # the load
        for write, commands in zip(writes, others):
            results.append(run(write))
            with ThreadPoolExecutor(2) as pool:
                results += pool.map(run, commands)
    failures = [(m, rc, err[-2000:]) for m, rc, err in results if rc != 0 or "terminate called" in err]
    assert not failures, "\n\n".join(f"python -m {m}: exit {rc}\n{err}" for m, rc, err in failures)
    assert len(results) == len(writes) + sum(map(len, others))
