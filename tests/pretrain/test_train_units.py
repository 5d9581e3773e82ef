"""Fast tests of the training pieces that need no process group: schedules, durations, AdamW groups, losses,
the resume order, RNG state, the metrics interface and the recorder's logs; and one start of `pretrain.train` past a
stale build lock."""

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain import checkpointer as ckpt
from pretrain import randomness
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.run_folder import BATCH_DIGESTS_DIR, COMPLETE, SAMPLE_KEYS_DIR, IncompleteCheckpointError
from pretrain.checkpoint.safe_load import load_weights_only
from pretrain.config.optim import LRSchedule, build_optimizer, duration_to_steps, no_decay_names
from pretrain.config.train_config import CheckpointConfig, LoggingConfig, load_config
from pretrain.distributed import Readback
from pretrain.model.tasks import (
    TASKS,
    ClassificationTask,
    TaskConfig,
    build_task,
    register_task,
    sigmoid_xent,
    softmax_xent,
)
from pretrain.model.vit import build_model
from pretrain.telemetry.metrics import NonFiniteLossError, TrainMetrics
from pretrain.telemetry.recorder import Recorder
from tracking import keys


def test_durations_convert_to_steps_in_one_place():
    assert duration_to_steps(10_000, 4096, None) == 10_000
    assert duration_to_steps("500st", 4096, None) == 500
    # 90 epochs of 12.4M images at batch 4096, rounded up
    assert duration_to_steps("90ep", 4096, 12_400_000) == math.ceil(90 * 12_400_000 / 4096) == 272_461
    assert duration_to_steps("1.2e6img", 4096, None) == math.ceil(1.2e6 / 4096)
    assert duration_to_steps(0, 64, None, zero_ok=True) == 0
    with pytest.raises(ValueError, match=r"schedule\.total='3ep' counts epochs.*data\.epoch_images"):
        duration_to_steps("3ep", 64, None, field="schedule.total")
    with pytest.raises(ValueError, match="not a duration"):
        duration_to_steps("ten minutes", 64, None)
    with pytest.raises(ValueError, match="gives 0 steps"):
        duration_to_steps(0, 64, None)


def test_linear_schedule_warms_up_then_decays_to_end_lr():
    s = LRSchedule(peak_lr=1e-3, warmup_steps=10, total_steps=110, decay="linear", end_lr=1e-5)
    assert s(0) == pytest.approx(1e-4) and s(9) == pytest.approx(1e-3)
    assert s(10) == pytest.approx(1e-3)
    assert s(109) == pytest.approx(1e-5)  # the last update uses exactly end_lr
    lrs = [s(i) for i in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert s(59) == pytest.approx(1e-3 + (1e-5 - 1e-3) * 49 / 99)


def test_cosine_and_constant_schedules():
    c = LRSchedule(1.0, 0, 101, "cosine", 0.0)
    assert c(0) == pytest.approx(1.0) and c(50) == pytest.approx(0.5) and c(100) == pytest.approx(0.0)
    k = LRSchedule(0.1, 5, 50, "constant")
    assert k(2) == pytest.approx(0.06) and k(40) == pytest.approx(0.1)


def test_weight_decay_only_on_weight_matrices():
    task = ClassificationTask(build_model("vit_tiny_debug", num_classes=10, representation_size=64))
    skip = no_decay_names(task)
    names = dict(task.named_parameters())
    assert "model.cls_token" in skip and "model.pos_embed" in skip
    assert all(names[n].ndim < 2 for n in skip if n not in ("model.cls_token", "model.pos_embed"))
    decayed = set(names) - skip
    assert decayed and all(names[n].ndim >= 2 for n in decayed)
    assert any("patch" in n for n in decayed)  # the patch-embedding kernel is a weight matrix (4-D conv)
    opt = build_optimizer(task, load_config("vit_b16_i21k").optim)
    decay_group, plain_group = opt.param_groups
    assert decay_group["weight_decay"] == 0.03 and plain_group["weight_decay"] == 0.0
    assert opt.defaults["betas"] == (0.9, 0.999)
    assert len(decay_group["params"]) + len(plain_group["params"]) == len(names)
    # a GPU rank's optimizer runs AdamW's fused kernel; a CPU rank keeps torch's default (its pinned losses)
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None
    assert build_optimizer(task, load_config("vit_b16_i21k").optim, "cuda").defaults["fused"] is True


def test_softmax_xent_matches_torch_with_label_smoothing():
    logits, labels = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 4, 0])
    for eps in (0.0, 0.1):
        expected = F.cross_entropy(logits, labels, label_smoothing=eps)
        assert softmax_xent(logits, labels, eps).item() == pytest.approx(expected.item(), abs=1e-6)
    # soft targets (mixup): the same formula on the mixed one-hots
    soft = 0.7 * F.one_hot(labels, 5).float() + 0.3 * F.one_hot(labels.roll(1), 5).float()
    manual = -(soft * F.log_softmax(logits, -1)).sum(-1).mean()
    assert softmax_xent(logits, soft).item() == pytest.approx(manual.item(), abs=1e-6)


def test_sigmoid_xent_sums_over_classes_and_averages_over_batch():
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 3, 6, 2])
    onehot = F.one_hot(labels, 7).float()
    expected = F.binary_cross_entropy_with_logits(logits, onehot, reduction="sum") / 4
    assert sigmoid_xent(logits, labels).item() == pytest.approx(expected.item(), abs=1e-5)
    assert sigmoid_xent(logits, onehot).item() == pytest.approx(expected.item(), abs=1e-5)
    # head bias -10 makes the initial i21k loss small: K * softplus(-10) + softplus(10) - 10 ≈ K * 4.5e-5
    initial = sigmoid_xent(torch.full((2, 1000), -10.0), torch.tensor([1, 2])).item()
    assert initial == pytest.approx(999 * math.log1p(math.exp(-10)) + math.log1p(math.exp(10)), rel=1e-4)


def test_task_registry_builds_and_extends():
    config = load_config("local_demo")
    task = build_task(config, build_model("vit_tiny_debug", num_classes=4))
    loss, metrics = task(torch.rand(2, 3, 32, 32) * 2 - 1, torch.tensor([0, 3]))
    assert loss.ndim == 0 and torch.isfinite(loss) and 0.0 <= metrics["accuracy"].item() <= 1.0

    @register_task("test_constant_loss")
    def _build(config, model):
        return ClassificationTask(model, "sigmoid_xent")

    try:
        built = build_task(config.replace(task=TaskConfig(name="test_constant_loss")), task.model)
        assert built.loss_name == "sigmoid_xent"
    finally:
        TASKS.pop("test_constant_loss")


def test_start_point_follows_the_resume_order(tmp_path):
    base = load_config("local_demo", [f"checkpoint.dir={tmp_path / 'run'}"])
    assert ckpt.find_start(base).kind == "scratch"
    weights = tmp_path / "w.npz"
    weights.write_bytes(b"")
    with_init = load_config("local_demo", [f"checkpoint.dir={tmp_path / 'run'}", f"checkpoint.init_from={weights}"])
    assert ckpt.find_start(with_init) == ckpt.StartPoint("init_from", weights)
    other = tmp_path / "other" / "checkpoints" / "step_00000005"
    other.mkdir(parents=True)
    both = with_init.replace(
        checkpoint=CheckpointConfig(dir=str(tmp_path / "run"), resume_from=str(other), init_from=str(weights))
    )
    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint\.resume_from=\S*step_00000005 has no COMPLETE"):
        ckpt.find_start(both)  # an unfinished resume_from is refused, not skipped for init_from
    (other / COMPLETE).write_text("5\n")
    assert ckpt.find_start(both) == ckpt.StartPoint("resume_from", other)
    own = tmp_path / "run" / "checkpoints" / "step_00000007"
    own.mkdir(parents=True)
    (own / COMPLETE).write_text("7\n")
    assert ckpt.find_start(both) == ckpt.StartPoint("run", own)


def test_init_from_a_run_folder_is_its_newest_complete_checkpoint(tmp_path):
    """The weights-source rule of evals and exports (`pretrain.weights.source`), at load and at the start."""
    from pretrain.model.vit import model_config
    from tests.pretrain.test_export import _checkpoint, _random

    source = tmp_path / "source"
    newest = _checkpoint(source, 2, _random(model_config("vit_tiny_debug", num_classes=4)))
    _checkpoint(source, 3, _random(model_config("vit_tiny_debug", num_classes=4)), complete=False)
    config = load_config("local_demo", [f"checkpoint.dir={tmp_path / 'run'}", f"checkpoint.init_from={source}"])
    config.validate(2)
    assert ckpt.find_start(config) == ckpt.StartPoint("init_from", newest)
    (newest / COMPLETE).unlink()
    with pytest.raises(ValueError, match=r"^checkpoint\.init_from='\S+source': \S+ is a run folder without a COMPLETE"):
        config.validate(2)
    with pytest.raises(ValueError, match=r"^checkpoint\.init_from='\S+source': \S+ is a run folder without a COMPLETE"):
        ckpt.find_start(config)


def test_rng_state_round_trips_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(randomness.rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    randomness.set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_metrics_report_the_documented_keys_and_stop_on_non_finite_loss():
    m = TrainMetrics(
        rank=0,
        world_size=2,
        total_steps=4,
        flops_per_image=10**9,
        peak_tflops=1.0,
        device=torch.device("cpu"),
        log_every=2,
        progress_bar=False,
    )
    assert m.step(1, 2.0, 1e-3, 0.5, images=64, data_s=0.01) == {}
    logged = m.step(2, 1.9, 1e-3, 0.4, images=64, data_s=0.01)
    keys = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/images_per_s",
        "train/tflops",
        "train/mfu",
        "train/data_wait",
        "train/memory_gb",
        "train/images_seen",
        "train/exaflops",
        *(f"train/{what}_s_p{p}" for what in ("step", "data_wait") for p in (50, 90, 99)),
    }
    assert set(logged) == keys
    assert logged["train/images_seen"] == 128 and logged["train/exaflops"] == pytest.approx(128 * 1e9 / 1e18)
    assert logged["train/mfu"] == pytest.approx(logged["train/tflops"] / 1.0)
    assert 0 < logged["train/memory_gb"] < 64 and 0 <= logged["train/data_wait"] <= 1
    # Losses are read at the logging cadence (a GPU step does not wait for its own end), and before a save
    nan = Readback(torch.tensor(float("nan")))
    assert m.step(3, nan, 1e-3, None, images=64, data_s=0.0) == {} and "on the device" in repr(nan)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 3 .*optim\.lr"):
        m.step(4, 1.8, 1e-3, None, images=64, data_s=0.0)
    m._unread.clear()
    with pytest.raises(NonFiniteLossError, match=r"loss is inf at step 5"):
        m.step(5, float("inf"), 1e-3, None, images=64, data_s=0.0, read=True)
    mean = Readback(torch.tensor(3.0), divisor=2)
    assert float(mean) == 1.5 and float(mean) == 1.5 and repr(mean) == "Readback(1.5)"  # read once, then kept


def test_cli_rejects_bad_configs_before_any_work(tmp_path, capsys, monkeypatch):
    from pretrain.train import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    run_dir = tmp_path / "run"
    code = main(["--config", "local_demo", "--set", "deepspeed.zero_stage=4", "--set", f"checkpoint.dir={run_dir}"])
    assert code == 2 and "deepspeed.zero_stage=4 is not a ZeRO stage" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing was started or written
    code = main(["--config", "local_demo", "--dry-run", "--set", f"data.train={tmp_path}/rcdb/train"])
    assert code == 0 and "micro-batch 32 x accumulation 1 x world 2 = global batch 64" in capsys.readouterr().out


def test_a_rank_ends_after_its_exit_handlers_and_keeps_its_code(tmp_path):
    # exit_rank runs what the process registered to run at exit and keeps what it printed without a newline, both
    # on a normal exit (no process group, as here) and on the os._exit path a live group takes (docs/reference.md §7).
    script = (
        "import atexit, pathlib, sys\n"
        "from pretrain.distributed import exit_rank\n"
        f"atexit.register(pathlib.Path({str(tmp_path / 'handler_ran')!r}).touch)\n"
        "print('unflushed', end='')\n"
        "sys.stderr.write('err')\n"
        "exit_rank(3)\n"
        "print('never')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as a rank's output into a pipe is by default
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 3
    assert result.stdout == "unflushed" and result.stderr == "err"
    assert (tmp_path / "handler_ran").exists()


def test_init_from_copies_matching_weights_and_reports_the_rest(tmp_path):
    from pretrain.weights.formats import save_pretrained

    torch.manual_seed(0)
    source = build_model("vit_tiny_debug", num_classes=10)
    save_pretrained(source, tmp_path / "src")
    target = build_model("vit_tiny_debug", image_size=64, num_classes=4)  # other resolution and class count
    with pytest.warns(UserWarning, match="kept the fresh initialisation"):
        skipped = ckpt.init_weights(target, tmp_path / "src", image_size=64)
    assert skipped == ["head.bias", "head.weight"]
    src, dst = source.state_dict(), target.state_dict()
    assert torch.equal(dst["blocks.0.attn.qkv.weight"], src["blocks.0.attn.qkv.weight"])
    assert dst["pos_embed"].shape == (1, 1 + 16 * 16, 64)  # resized from the 8x8 grid by the loader
    assert torch.equal(dst["pos_embed"][:, 0], src["pos_embed"][:, 0])  # the class-token slot is kept as is


def test_init_from_weights_of_another_architecture_is_refused(tmp_path):
    """Before, a few same-shape tensors were copied, a warning listed the rest and the run trained from scratch."""
    from pretrain.weights.formats import save_pretrained

    save_pretrained(build_model("vit_tiny_debug", num_classes=10), tmp_path / "src")
    target = build_model("vit_tiny_debug", depth=2, mlp_dim=128, num_classes=4)
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError) as refused:
        ckpt.init_weights(target, tmp_path / "src", image_size=32)
    assert str(refused.value) == (
        f"checkpoint.init_from={tmp_path / 'src'}: its weights are of another architecture than the recipe's model "
        "(depth 4, not 2; mlp_dim 256, not 128), so the run would train from a fresh initialisation; set model.name "
        "to the weights' model (and model.* to match), or point checkpoint.init_from at weights of this architecture"
    )
    assert all(torch.equal(v, fresh[k]) for k, v in target.state_dict().items())  # nothing copied
    # Under Ray the job fails at once, no worker-group restart spent (an .npz or URL is only read in the ranks).
    from cluster.driver.watchdog import final_failure

    assert final_failure({0: RuntimeError("a worker died"), 1: refused.value}) == (1, refused.value)
    gap = build_model("vit_tiny_debug", pool="gap", num_classes=4)  # another pool is a fine-tune: still copied
    with pytest.warns(UserWarning, match="kept the fresh initialisation"):
        assert ckpt.init_weights(gap, tmp_path / "src", image_size=32) == ["head.bias", "head.weight"]


class _Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_engine_files_are_read_weights_only(tmp_path, capsys):
    import types

    engine = types.SimpleNamespace()
    load_weights_only(engine)
    good = tmp_path / "good.pt"
    torch.save({"module": {"w": torch.ones(2)}, "zero_stage": 2}, good)
    assert torch.equal(engine.load(str(good))["module"]["w"], torch.ones(2))
    bad = tmp_path / "bad.pt"
    torch.save({"payload": _Exploit()}, bad)
    # Refused as bad input in one line (a checkpoint without checksums.json reaches the load unchecked).
    with pytest.raises(ValueError, match=r"bad.pt cannot be loaded \(Weights only load failed.*resume from another"):
        engine.load(str(bad))
    assert "this must never run" not in capsys.readouterr().out
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut.pt cannot be loaded \(PytorchStreamReader failed .*\): resume from"):
        engine.load(str(cut))


def test_only_a_build_lock_that_a_killed_process_left_is_removed(tmp_path, monkeypatch, capsys):
    from pretrain.distributed import ORPHAN_LOCK_S, SHM_COMM_OP, remove_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's builder puts the op's folder there
    lock = tmp_path / SHM_COMM_OP / "lock"
    lock.parent.mkdir()

    def age(seconds: float) -> None:
        then = time.time() - seconds
        os.utime(lock, (then, then))

    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # what torch's FileBaton does while it builds or checks the op
    try:
        age(ORPHAN_LOCK_S + 60)
        assert remove_stale_build_lock(SHM_COMM_OP) is None and lock.exists()  # held open: a build under way
    finally:
        os.close(fd)  # the holder ends without deleting it, as a killed one does
    age(ORPHAN_LOCK_S - 20)
    assert remove_stale_build_lock(SHM_COMM_OP) is None and lock.exists()  # too young to judge
    age(ORPHAN_LOCK_S + 20)
    assert remove_stale_build_lock(SHM_COMM_OP) == lock and not lock.exists()
    assert f"removed {lock}" in capsys.readouterr().err
    assert remove_stale_build_lock(SHM_COMM_OP) is None  # nothing there: nothing to do


def test_deepspeed_is_imported_without_mlflow_and_inductor_and_its_muon_names_are_all_there():
    """`import_deepspeed` leaves out the two imports DeepSpeed makes for features never run here (MLflow for its
    autotuner, Inductor for its Muon optimizer), leaves MLflow importable after, and its Muon stand-in provides every
    name the installed DeepSpeed imports from the Muon modules (read from DeepSpeed's source, so a DeepSpeed that
    imports another name fails here, not in a run)."""
    import ast
    import importlib.util

    from pretrain.distributed import MUON_MODULES, MUON_NAMES

    code = (
        "import sys\n"
        "from pretrain.distributed import import_deepspeed\n"
        "deepspeed = import_deepspeed()\n"
        "assert import_deepspeed() is deepspeed\n"
        "print(sorted(m for m in ('mlflow', 'torch._inductor') if m in sys.modules))\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
        "try:\n"
        "    MuonWithAuxAdam([])\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
        "import mlflow\n"
        "print('mlflow', mlflow.__version__ != '')\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "[]" and lines[-1] == "mlflow True", done.stdout
    assert "refused: DeepSpeed's Muon optimizer is not loaded" in done.stdout

    package = Path(importlib.util.find_spec("deepspeed").origin).parent
    muon_package = "deepspeed.runtime.zero.muon"
    imported: dict[str, set[str]] = {}
    for source in package.rglob("*.py"):
        if "muon" in source.parts:  # the replaced modules themselves
            continue
        text = source.read_text(errors="replace")
        if "muon" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(muon_package):
                imported.setdefault(node.module, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith(muon_package) for a in node.names), source
    assert set(imported) <= set(MUON_MODULES), imported
    assert set().union(*imported.values()) <= set(MUON_NAMES), imported
    assert imported, "DeepSpeed no longer imports its Muon modules: import_deepspeed's stand-in can go"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_starts_past_the_build_lock_a_killed_run_left(tiny_fractal_shards, train_cli, tmp_path, monkeypatch):
    # The lock of the op's build folder, as a run killed while DeepSpeed loaded the op leaves it: without the check,
    # this run would wait on it forever (seen in this project: every later test timed out). In a private copy of the
    # extensions folder: other DeepSpeed starts on the machine (test workers) hold the real lock for a second each.
    from torch.utils.cpp_extension import _get_build_directory

    from pretrain.distributed import ORPHAN_LOCK_S, SHM_COMM_OP

    built = Path(_get_build_directory(SHM_COMM_OP, verbose=False))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    private = Path(_get_build_directory(SHM_COMM_OP, verbose=False))
    if built.is_dir():  # reuse the op built on this machine (else this run builds it once, in its private folder)
        shutil.copytree(built, private, ignore=shutil.ignore_patterns("lock"), dirs_exist_ok=True)
    private.mkdir(parents=True, exist_ok=True)
    lock = private / "lock"
    lock.touch()
    old = time.time() - ORPHAN_LOCK_S - 60
    os.utime(lock, (old, old))
    run_dir = tmp_path / "run"
    overrides = [
        f"data.train={tiny_fractal_shards}",
        "data.builtin=null",
        "data.global_batch_size=8",
        "data.micro_batch_size=8",
        "data.streams=4",
        "schedule.total=2",
        "schedule.warmup=1",
        f"checkpoint.dir={run_dir}",
        "logging.progress_bar=false",
        "deepspeed.precision=fp32",
    ]
    train_cli(load_config("local_demo", overrides), run_dir, timeout=300)
    assert f"removed {lock}" in (run_dir / "output.log").read_text() and not lock.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_standalone_run_ends_the_mlflow_run_it_created(tiny_fractal_shards, train_cli, tmp_path, mlflow_uri):
    # logging.mlflow_experiment without a run id: the trainer creates the MLflow run, so it must end it too (before,
    # such runs stayed RUNNING for good); stopped at stop_at_step is FINISHED, a diverged run FAILED.
    from mlflow import MlflowClient

    uri = mlflow_uri
    common = [
        f"data.train={tiny_fractal_shards}",
        "data.builtin=null",
        "data.global_batch_size=8",
        "data.micro_batch_size=8",
        "data.streams=4",
        "schedule.total=4",
        "schedule.warmup=1",
        "logging.progress_bar=false",
        "deepspeed.precision=fp32",
        f"logging.mlflow_tracking_uri={uri}",
        "logging.log_every=1",
    ]
    stopped = load_config(
        "local_demo",
        [
            *common,
            "schedule.stop_at_step=2",
            "logging.mlflow_experiment=stopped",
            f"checkpoint.dir={tmp_path / 'stopped'}",
        ],
    )
    train_cli(stopped, tmp_path / "stopped")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("stopped").experiment_id])
    assert (run.info.status, run.data.tags[keys.STATUS]) == ("FINISHED", "stopped")
    assert [m.step for m in client.get_metric_history(run.info.run_id, keys.LOSS)] == [1, 2]

    diverged = load_config(
        "local_demo",
        [
            *common,
            "optim.lr=1e30",
            "optim.grad_clip=0",
            "logging.mlflow_experiment=diverged",
            f"checkpoint.dir={tmp_path / 'diverged'}",
        ],
    )
    train_cli(diverged, tmp_path / "diverged", fails=True)
    log = (tmp_path / "diverged" / "output.log").read_text()
    assert "python -m pretrain.train: error: loss is nan at step " in log and "Traceback" not in log, log[-3000:]
    (run,) = client.search_runs([client.get_experiment_by_name("diverged").experiment_id])
    assert (run.info.status, run.data.tags[keys.STATUS]) == ("FAILED", "failed")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_lost_right_after_a_checkpoint_has_sent_the_metrics_of_its_steps(
    tiny_fractal_shards, train_env, tmp_path, mlflow_uri
):
    # The tracker sends at most once a second; the checkpoint of step 3 is published only once steps 1-3 are in the
    # MLflow run (Tracker.sync before the save). The process dies the moment the checkpoint is COMPLETE (os._exit: no
    # exit handlers, no last flush), like a worker lost with its node; the group would resume from step 3 and never
    # train steps 1-3 again, so the run must already hold them. (A CI run once lost step 20 of the elastic demo so.)
    # Step 3's pin for its evals was written with the checkpoint, so it outlives the process too: the next job's
    # eval scheduler finds it (cluster.driver.eval_scheduler.EvalScheduler.catch_up).
    from mlflow import MlflowClient

    from tracking.runs import create_run

    uri = mlflow_uri
    run_id = create_run(uri, "lost", "local_demo", {}, {})
    config = load_config(
        "local_demo",
        [
            f"data.train={tiny_fractal_shards}",
            "data.builtin=null",
            "data.global_batch_size=8",
            "data.micro_batch_size=8",
            "data.streams=4",
            "schedule.total=6",
            "schedule.warmup=1",
            "checkpoint.every_steps=3",
            "evals.suite=null",
            "logging.progress_bar=false",
            "deepspeed.precision=fp32",
            f"logging.mlflow_tracking_uri={uri}",
            f"logging.mlflow_run_id={run_id}",
            "logging.log_every=1",
            f"checkpoint.dir={tmp_path / 'run'}",
        ],
    )
    config.save(tmp_path / "recipe.yaml")
    code = (
        "import os, sys\nfrom pretrain.config.train_config import load_config\n"
        "from pretrain.loop import train_worker\n"
        "train_worker(load_config(sys.argv[1]), on_checkpoint=lambda folder, step, m: step == 3 and os._exit(17),\n"
        "             pin=lambda step: f'evals fast pending on step {step}' if step == 3 else None)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "recipe.yaml")],
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 17, (done.stdout + done.stderr)[-4000:]
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(run_id, keys.WORLD_SIZE_METRIC)] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, keys.LOSS)] == [1, 2, 3]
    step3 = run_folder.checkpoint_dir(tmp_path / "run", 3)
    assert run_folder.pinned_checkpoints(tmp_path / "run") == [step3] and run_folder.is_complete(step3)
    assert (step3 / run_folder.PINNED).read_text() == "evals fast pending on step 3\n"
    assert checksums.verify(step3).status == "verified"  # the pin is not among the recorded files


@pytest.mark.parametrize(
    ("accelerator", "gpu", "expected"),
    [(None, False, "cpu"), (None, True, "cuda"), ("cpu", True, "cpu"), ("cuda", True, "cuda"), ("cpu", False, "cpu")],
)
def test_ds_accelerator_cpu_keeps_training_on_the_cpu_beside_a_gpu(monkeypatch, accelerator, gpu, expected):
    # On a GPU machine, DS_ACCELERATOR=cpu makes DeepSpeed place everything on the CPU; the process group and the
    # model must follow, or the first broadcast fails ("No backend type associated with device type cpu", seen on
    # an H200 with nccl). Whether torch sees a GPU is the one thing simulated here.
    from pretrain.distributed import training_device_type

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    if accelerator is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", accelerator)
    assert training_device_type() == expected


def test_the_collector_is_paused_over_a_start_and_resumed_with_its_objects_frozen():
    """`python -m pretrain.train` and a Ray Train worker pause CPython's collector over their start; `resume` frees
    the start's cyclic garbage, freezes the survivors out of later passes and starts it again. Where it was off by
    someone else's choice, or never paused, both leave it as it is."""
    import gc
    import weakref

    from pretrain import collector

    class Cycle:
        def __init__(self):
            self.me = self

    assert gc.isenabled()
    try:
        collector.resume()  # never paused: nothing changes
        assert gc.isenabled() and gc.get_freeze_count() == 0
        collector.pause()
        assert not gc.isenabled()
        garbage = weakref.ref(Cycle())  # only the collector can free it
        assert garbage() is not None
        collector.resume()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert garbage() is None  # freed, not frozen
        gc.disable()  # off by someone else's choice: left off
        collector.pause()
        collector.resume()
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_rank_never_generates_data_the_command_line_does(tmp_path):
    """`prepare_data` (every rank's start) refuses a missing built-in set with the fix; `DataConfig.ensure_builtin`,
    which `python -m pretrain.train` and the cluster driver call before training, writes it once."""
    from pretrain.distributed import Placement
    from pretrain.trainer import prepare_data

    sizes = {"num_classes": 4, "images_per_class": 8, "val_per_class": 1, "resolution": 32, "samples_per_shard": 16}
    config = load_config(
        "local_demo", [f"data.train={tmp_path / 'rcdb' / 'train'}", f"data.builtin_options={json.dumps(sizes)}"]
    )
    place = Placement(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"holds no shard folder.*python -m data_pipeline\.builtin rcdb --out "):
        prepare_data(config, place)
    assert not (tmp_path / "rcdb").exists()
    config.data.ensure_builtin()
    config.data.ensure_builtin()  # present: nothing to do
    assert prepare_data(config, place) == (4, 32)


def test_the_recorder_writes_each_steps_digest_and_keys_where_a_ray_job_leaves_them(tmp_path):
    """Under Ray no summary comes back: a rank's digests and keys must be in the run folder, a line per step, an
    attempt's lines after the one before."""

    def attempt(number: int, steps: range, logging: LoggingConfig) -> list:
        recorder = Recorder.for_run(tmp_path, logging, rank=1, world_size=2, attempt=number)
        for step in steps:
            recorder.batch(torch.full((2, 3, 4, 4), float(step)), torch.tensor([step, 0]), [f"k{step}a", f"k{step}b"])
            recorder.end_step(step, loss=1.0 / step, epoch=0)
        recorder.close()
        return recorder.summary(rank=1, world_size=2, start="run", start_step=0, steps=0, images_seen=0).digests

    both = LoggingConfig(record_batch_digests=True, record_sample_keys=True)
    digests = attempt(0, range(1, 3), both) + attempt(1, range(3, 4), both)
    lines = [json.loads(line) for line in (tmp_path / BATCH_DIGESTS_DIR / "rank1.jsonl").read_text().splitlines()]
    assert [[entry["step"], entry["digest"]] for entry in lines] == digests and len(set(d for _, d in digests)) == 3
    assert [(entry["attempt"], entry["rank"], entry["world_size"]) for entry in lines] == [(0, 1, 2)] * 2 + [(1, 1, 2)]
    keys = [json.loads(line) for line in (tmp_path / SAMPLE_KEYS_DIR / "rank1.jsonl").read_text().splitlines()]
    assert [entry["keys"] for entry in keys] == [["k1a", "k1b"], ["k2a", "k2b"], ["k3a", "k3b"]]

    shutil.rmtree(tmp_path / SAMPLE_KEYS_DIR)
    attempt(2, range(4, 5), LoggingConfig(record_batch_digests=True))  # keys not asked for: no keys folder
    assert not (tmp_path / SAMPLE_KEYS_DIR).exists()
    assert len((tmp_path / BATCH_DIGESTS_DIR / "rank1.jsonl").read_text().splitlines()) == 4
