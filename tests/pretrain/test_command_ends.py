"""How the `python -m pretrain.*` commands end when there is nothing to do or the user presses Ctrl-C, as real
processes on real DeepSpeed and real run folders:

- a finished run launched again says in one line that its checkpoint already reaches ``schedule.total`` (exit 0),
  the same for ``schedule.stop_at_step`` and for ``checkpoint.resume_from``, and starts nothing (no attempt, no
  world-size record); a ``schedule.total`` below the checkpoint's step is refused in one line (exit 2);
- bad input, a checkpoint of another model among them (a changed ``model.name`` in a run folder, a
  ``checkpoint.resume_from`` of another model), is one ``python -m pretrain.train: error:`` line, exit 2, before
  anything starts;
- SIGINT in training (after a checkpoint) and in ``verify`` ends with one line saying what is kept and how to go on,
  exit 130 and no traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpointer import nothing_to_train
from pretrain.config.train_config import load_config
from pretrain.model.vit import build_model
from pretrain.train import main as train_main
from pretrain.weights.formats import save_pretrained
from tests.support.interrupt import ctrl_c

ROOT = Path(__file__).resolve().parents[2]


def _tiny(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        f"data.train={shards}",
        "data.builtin=null",
        "data.global_batch_size=8",
        "data.micro_batch_size=8",
        "data.streams=4",
        "schedule.warmup=1",
        f"checkpoint.dir={run_dir}",
        "logging.progress_bar=false",
        "deepspeed.precision=fp32",
        "evals.suite=null",
        *overrides,
    ]


def _launched(recipe: Path, capsys, *sets: str) -> tuple[int, str, str]:
    """`python -m pretrain.train --config RECIPE --set ...` in this process: it ends before DeepSpeed starts."""
    code = train_main(["--config", str(recipe), *(a for s in sets for a in ("--set", s))])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_finished_run_launched_again_says_so_in_one_line_and_a_lower_total_is_refused(
    tiny_fractal_shards, train_cli, tmp_path, capsys
):
    run = tmp_path / "run"
    train_cli(load_config("local_demo", _tiny(tiny_fractal_shards, run, "schedule.total=3")), run, timeout=300)
    final = run_folder.checkpoint_dir(run, 3)
    done = (run / "output.log").read_text().splitlines()[-1]  # the run's end: its loss rounded, where it is kept
    said = rf"done: 3 steps, final loss \d+\.\d{{4}}, images seen 24; newest checkpoint {final}"
    assert re.fullmatch(said, done), done
    recipe, starts = run / "recipe.yaml", (run / run_folder.WORLD_SIZES).read_text()
    code, out, err = _launched(recipe, capsys)
    assert code == 0, err[-3000:]
    assert out.splitlines() == [
        f"nothing to train: the run folder's newest checkpoint {final} is at step 3, which reaches schedule.total=3: "
        "the run is done; to train further, raise schedule.total (--set schedule.total=N: the lr schedule changes "
        "from here on), or set another checkpoint.dir to train a new run"
    ]
    assert "None" not in out + err
    # At stop_at_step: done too (it may change between starts). Neither started an attempt.
    code, out, err = _launched(recipe, capsys, "schedule.total=4", "schedule.stop_at_step=3")
    assert code == 0, err[-3000:]
    assert out.startswith(f"nothing to train: the run folder's newest checkpoint {final} is at step 3, ")
    assert "schedule.stop_at_step=3; to train on towards schedule.total=4, raise" in out
    assert (run / run_folder.WORLD_SIZES).read_text() == starts
    # Past a lower total: refused, the run's own total named.
    code, out, err = _launched(recipe, capsys, "schedule.total=2")
    assert code == 2 and out == "", err[-3000:]
    assert err.splitlines() == [
        f"python -m pretrain.train: error: the run folder's newest checkpoint {final} is at step 3, past "
        "schedule.total=2: resuming at a lower "
        "total would follow another lr schedule; set schedule.total back to the run's own, 3, or set another "
        "checkpoint.dir to train a new run"
    ]
    # The same from another run's checkpoint (checkpoint.resume_from), in an empty run folder that stays empty.
    other = tmp_path / "other"
    code, out, err = _launched(recipe, capsys, f"checkpoint.dir={other}", f"checkpoint.resume_from={final}")
    assert code == 0, err[-3000:]
    assert out.startswith(f"nothing to train: checkpoint.resume_from={final} is at step 3, which ")
    assert out.rstrip().endswith("or drop checkpoint.resume_from") and not other.exists()


def test_bad_input_is_one_error_line_that_names_the_command(capsys):
    for sets, says in (
        (["optim.lrr=3e-4"], r"unknown key\(s\) \['optim.lrr'\]"),
        (["optim.lr"], r"'optim.lr' is not key=value"),
        (["model.name=vit_x"], r"model.name='vit_x' is unknown"),
    ):
        code, out, err = _launched(ROOT / "configs" / "local_demo.yaml", capsys, *sets, "logging.log_every=1")
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith("python -m pretrain.train: error: ") and re.search(says, err), err


def test_bad_input_under_torchrun_is_one_line_per_machine_not_one_per_rank(train_env, tmp_path):
    """Every rank of `torchrun --nproc-per-node 8 -m pretrain.train ...` read the same bad recipe and printed the same
    line: 8 of them a node. Found before training starts, it is printed by each machine's local rank 0."""
    from tests.support import warm_ranks

    log = tmp_path / "ranks.log"
    args = ["--config", str(ROOT / "configs" / "local_demo.yaml"), "--set", "optim.lr=abc"]
    assert warm_ranks.launch("pretrain.train", args, 2, train_env(), log, 120) == 1  # as torchrun: a rank failed
    said = [line for line in log.read_text().splitlines() if "error" in line]  # the zygote's runpy warnings aside
    assert said == ["python -m pretrain.train: error: --set override: optim.lr must be a number, got 'abc'"], said


def test_a_checkpoint_of_another_model_is_refused_in_one_line_before_anything_starts(
    tiny_fractal_shards, tmp_path, capsys
):
    """A changed model.name in a run folder, or a resume_from of another model: before, DeepSpeed started and its
    size mismatches ended the rank in a traceback."""
    run, recipe = tmp_path / "run", ROOT / "configs" / "local_demo.yaml"
    config = load_config(recipe, _tiny(tiny_fractal_shards, run))
    folder = run_folder.checkpoint_dir(run, 2)
    save_pretrained(build_model("vit_tiny_debug", num_classes=4), folder)
    config.save(folder / run_folder.CONFIG_YAML)
    (folder / run_folder.COMPLETE).write_text("2\n")
    assert nothing_to_train(config) is None  # the same model: no step recorded, so the start goes on
    code, out, err = _launched(recipe, capsys, *_tiny(tiny_fractal_shards, run), "model.name=vit_s16")
    assert code == 2 and out == "", err[-3000:]
    assert err.splitlines() == [
        f"python -m pretrain.train: error: the run folder's newest checkpoint {folder} holds another model than "
        "model.name=vit_s16 builds (patch_size 4, not 16; width 64, not 384; depth 4, not 12; num_heads 4, not 6; "
        "mlp_dim 256, not 1536): a resume cannot load it; set the model back to the checkpoint's "
        "(model.name=vit_tiny_debug), or set another checkpoint.dir to train a new run"
    ]
    assert [p.name for p in run.iterdir()] == ["checkpoints"]  # no attempt, no world-size record
    other = tmp_path / "other"
    sets = (*_tiny(tiny_fractal_shards, other), "model.name=vit_s16", f"checkpoint.resume_from={folder}")
    code, out, err = _launched(recipe, capsys, *sets)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith(f"python -m pretrain.train: error: checkpoint.resume_from={folder} holds another model ")
    assert err.rstrip().endswith("or drop checkpoint.resume_from") and not other.exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_in_training_keeps_the_newest_complete_checkpoint_and_exits_130(
    tiny_fractal_shards, train_env, tmp_path
):
    run = tmp_path / "run"
    sets = _tiny(tiny_fractal_shards, run, "schedule.total=10000", "checkpoint.every_steps=2", "logging.log_every=1")
    cmd = [sys.executable, "-m", "pretrain.train", "--config", "local_demo", *(a for s in sets for a in ("--set", s))]
    # step 3's line comes after step 2's checkpoint is COMPLETE
    done = ctrl_c(cmd, lambda out: "\nstep 3/" in f"\n{out.read_text()}", tmp_path, env=train_env())
    code, out, err = done.returncode, done.stdout, done.stderr
    newest = run_folder.latest_checkpoint(run)
    assert newest is not None and checksums.verify(newest).ok, (out[-2000:], err[-3000:])
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        f"python -m pretrain.train: interrupted; kept {newest}, the newest complete checkpoint: the same command "
        "resumes from it"
    ]


@pytest.mark.timeout(120)
def test_ctrl_c_in_verify_says_nothing_changed_and_exits_130(tmp_path):
    # Two checkpoints: a small one, listed at once, then one of a 2 GiB file (sparse: no disk) that takes seconds.
    for step, size in ((1, 1000), (2, 2 << 30)):
        folder = run_folder.checkpoint_dir(tmp_path, step)
        folder.mkdir(parents=True)
        with open(folder / "weights.bin", "wb") as f:
            f.truncate(size)
        checksums.write(folder, {"weights.bin": (size, "00000000")})  # never read to the end
        (folder / run_folder.COMPLETE).write_text(f"{step}\n")
    cmd = [sys.executable, "-m", "pretrain.checkpoint", "verify", str(tmp_path)]
    first = str(run_folder.checkpoint_dir(tmp_path, 1))
    (logs := tmp_path / "logs").mkdir()
    done = ctrl_c(cmd, lambda out: first in out.read_text(), logs)
    code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert len(out.splitlines()) == 1 and err.splitlines() == [
        "python -m pretrain.checkpoint: interrupted; nothing changed; the checkpoints listed above were "
        "checked, the same command checks them all"
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_diverged_run_ends_every_rank_with_one_line_and_exit_1(tiny_fractal_shards, train_env, tmp_path):
    # Before, NonFiniteLossError reached each rank as a traceback. A diverged run failed (exit 1, not bad input's 2)
    # on every rank, so torchrun and Ray see each end; one line per machine says why and what to try.
    from cluster.local_head import free_port

    sets = _tiny(
        tiny_fractal_shards,
        tmp_path / "run",
        "data.micro_batch_size=4",
        "schedule.total=4",
        "logging.log_every=1",
        "optim.lr=1e30",
    )
    cmd = [sys.executable, "-m", "pretrain.train", "--config", "local_demo"]
    cmd += [a for s in (*sets, "optim.grad_clip=0") for a in ("--set", s)]
    world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = []
    for rank in range(2):
        env = {**train_env(), **world, "RANK": str(rank), "LOCAL_RANK": str(rank), "PYTHONUNBUFFERED": "1"}
        err = open(tmp_path / f"stderr_{rank}.txt", "w")
        ranks.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
        err.close()
    codes = [rank.wait(timeout=240) for rank in ranks]
    errs = [(tmp_path / f"stderr_{rank}.txt").read_text() for rank in range(2)]
    assert codes == [1, 1], errs[0][-3000:]
    assert not any("Traceback" in err for err in errs), errs[0][-3000:]
    (line,) = [line for line in errs[0].splitlines() if "error:" in line]
    assert line.startswith("python -m pretrain.train: error: loss is nan at step 2 (lr 1e+30); training stopped. ")
    assert "error:" not in errs[1]  # the same line for each machine, not for each rank
