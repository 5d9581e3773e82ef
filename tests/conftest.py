"""Suite-wide settings: CPU DeepSpeed, GPU tests skipped with a reason when no CUDA device is present."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# DeepSpeed picks its accelerator at import time; the suite runs on CPU unless a GPU test asks otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none on this machine); runs on the GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: on 2 shared cores, torch's own threads only contend with the other test processes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_fractal_shards(tmp_path_factory) -> Path:
    """A tiny fractal set at 32 px: 4 classes x 16 images in 4 shards (2 ranks need >= 2 shards)."""
    from data_pipeline.builtin import ensure

    root = tmp_path_factory.mktemp("data")
    ensure("fractal", root, resolution=32, num_classes=4, images_per_class=16, val_per_class=1, samples_per_shard=16)
    return root / "fractal" / "train"


@pytest.fixture
def train_cli():
    """Run `python -m pretrain.train` on a TrainConfig in a process session of its own (a timeout kills the whole
    tree, nothing leaks) and return its summary; the config is saved as `<run_dir>/recipe.yaml` first, what it
    printed as `<run_dir>/output.log` after. ``fails=True``: the run must end with a non-zero status (returns None)."""

    def run(config, run_dir: Path, timeout: float = 400, fails: bool = False) -> dict | None:
        run_dir.mkdir(parents=True, exist_ok=True)
        config.save(run_dir / "recipe.yaml")
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "pretrain.train", "--config", str(run_dir / "recipe.yaml"),
               "--summary", str(run_dir / "summary.json")]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"training timed out:\n{out[-4000:]}")
        (run_dir / "output.log").write_text(out)  # what it printed (stdout and stderr), for tests that read it
        if fails:
            assert proc.returncode != 0, out[-6000:]
            return None
        assert proc.returncode == 0, out[-6000:]
        return json.loads((run_dir / "summary.json").read_text())

    return run
