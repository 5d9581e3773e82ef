"""pretrain.checkpoint.run_folder: the run folder's layout, without torch (names, listing, the trainer state, opening
for evals, the one incomplete-checkpoint error, pins and pruning)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.checkpoint import run_folder as rf

PROJECT = Path(__file__).resolve().parents[2]

# A trainer state as pretrain.checkpointer.save_checkpoint writes it (2 ranks; one global stream position).
STATE = (
    '{"step": 20, "images_seen": 1280, "world_size": 2, "deepspeed_tag": "step_00000020", "stream_state": '
    '{"version": 2, "epoch": 1, "step": 3, "draws": {"0": 7, "1": 2}}, "rng_states": [{"python": [3, [1, 2], '
    'null], "numpy": ["MT19937", [5, 6], 624, 0, 0.0], "torch": "AAE="}, {"python": [3, [3, 4], null], "numpy": '
    '["MT19937", [7, 8], 624, 0, 0.0], "torch": "AAI="}], "metrics": {"train/loss": 2.5}, "saved_at": 1763900000.25, '
    '"precision": "bf16"}'
)
# What it wrote before the data order became world-size-invariant: a position per rank.
PER_RANK_STATE = STATE.replace(
    '"stream_state": {"version": 2, "epoch": 1, "step": 3, "draws": {"0": 7, "1": 2}}',
    '"stream_states": [{"epoch": 1, "position": [3, 7]}, {"epoch": 1, "position": [4, 2]}]',
)


def _folders(run: Path, complete=(), unmarked=(), staging=()) -> dict[int, Path]:
    out = {}
    for step in (*complete, *unmarked):
        out[step] = rf.checkpoint_dir(run, step)
        out[step].mkdir(parents=True)
        if step in complete:
            (out[step] / rf.COMPLETE).write_text(f"{step}\n")
    for step in staging:
        rf.staging_dir(run, step).mkdir(parents=True)
    return out


def test_import_is_torch_free():
    code = "import sys, pretrain.checkpoint.run_folder; assert not {'torch', 'numpy', 'deepspeed'} & set(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_names():
    assert rf.step_name(120) == "step_00000120" and rf.parse_step("step_00000120") == 120
    assert rf.step_name(123_456_789) == "step_123456789" and rf.parse_step("step_123456789") == 123_456_789
    assert [rf.parse_step(n) for n in ("step_00000120.tmp", "step_", "step_x", "checkpoints")] == [None] * 4
    run = Path("/runs/a")
    assert rf.checkpoint_dir(run, 7) == run / "checkpoints" / "step_00000007"
    assert rf.staging_dir(run, 7) == run / "checkpoints" / "step_00000007.tmp"


def test_listing_ignores_staging_unmarked_and_other_folders_and_keeps_pinned(tmp_path):
    f = _folders(tmp_path, complete=(10, 20, 100), unmarked=(30,), staging=(40,))
    (tmp_path / "checkpoints" / "notes").mkdir()
    (tmp_path / "checkpoints" / "step_00000050").write_text("a file, not a folder")
    assert rf.pin_checkpoint(f[100], "evals pending") and rf.is_pinned(f[100])
    assert rf.complete_checkpoints(tmp_path) == [f[10], f[20], f[100]]  # by step, not by name length or mtime
    assert rf.latest_checkpoint(tmp_path) == f[100]
    assert rf.latest_checkpoint(tmp_path / "nothing_here") is None and rf.complete_checkpoints(tmp_path / "x") == []


def test_the_incomplete_error_names_the_folder_and_the_fix(tmp_path):
    f = _folders(tmp_path, complete=(10, 20), unmarked=(30,))
    with pytest.raises(rf.IncompleteCheckpointError) as info:
        rf.require_complete(f[30])
    assert isinstance(info.value, ValueError)
    assert str(info.value) == (
        f"checkpoint folder {f[30]} has no COMPLETE marker: its save was interrupted or is still running; use a "
        f"finished checkpoint, a <run>/checkpoints/step_XXXXXXXX folder that holds COMPLETE (the newest complete one "
        f"beside it is {f[20]})"
    )
    with pytest.raises(rf.IncompleteCheckpointError, match=r"checkpoint\.resume_from=\S+ has no COMPLETE marker \(the"):
        rf.require_complete(tmp_path / "gone", "checkpoint.resume_from")
    with pytest.raises(rf.IncompleteCheckpointError, match="none beside it is complete"):
        rf.TrainerState.read(tmp_path)
    assert rf.require_complete(f[10]) == f[10]


def test_trainer_state_reads_the_file_and_writes_it_byte_for_byte(tmp_path):
    folder = _folders(tmp_path, complete=(20,))[20]
    (folder / rf.TRAINER_STATE).write_text(STATE)
    state = rf.TrainerState.read(folder)
    assert (state.step, state.images_seen, state.world_size, state.deepspeed_tag) == (20, 1280, 2, "step_00000020")
    assert state.stream_state["draws"] == {"0": 7, "1": 2} and state.rng_states[0]["torch"] == "AAE="
    assert state.metrics == {"train/loss": 2.5} and state.saved_at == 1763900000.25 and state.precision == "bf16"
    assert state.to_json() == STATE
    copy = tmp_path / "copy"
    copy.mkdir()
    state.write(copy)
    assert (copy / rf.TRAINER_STATE).read_text() == STATE
    assert rf.TrainerState.from_json(state.to_json()) == state
    # Written before the precision was recorded: read as unknown (a resumed auto run then probes, as it did then).
    older = STATE.replace(', "precision": "bf16"', "")
    assert rf.TrainerState.from_json(older).precision is None


def test_a_trainer_state_with_per_rank_stream_positions_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(ValueError, match=r"x\.json holds per-rank stream positions.*vitscale version that wrote it"):
        rf.TrainerState.from_json(PER_RANK_STATE, tmp_path / "x.json")


def test_world_size_history_keeps_every_start_in_order(tmp_path):
    assert rf.world_size_history(tmp_path) == []
    for step, size, accumulation in ((0, 2, 1), (40, 1, 2), (60, 2, 1)):
        rf.record_world_size(tmp_path, step, size, accumulation)
    with open(tmp_path / rf.WORLD_SIZES, "a") as f:
        f.write('{"time": 1, "st')  # a line cut short by a crash
    history = rf.world_size_history(tmp_path)
    assert [(r["step"], r["world_size"], r["accumulation"]) for r in history] == [(0, 2, 1), (40, 1, 2), (60, 2, 1)]


@pytest.mark.parametrize(
    "text, needle",
    [("{not json", "JSONDecodeError"), ("[1]", "JSON list"), ('{"step": 3}', "KeyError: 'rng_states'")],
)
def test_a_damaged_trainer_state_is_a_clear_error(tmp_path, text, needle):
    with pytest.raises(ValueError, match=rf"x\.json is not a trainer state .*{needle}.*resume from another one"):
        rf.TrainerState.from_json(text, tmp_path / "x.json")


def test_opening_a_checkpoint_for_evaluation(tmp_path):
    f = _folders(tmp_path, complete=(120, 130, 140), unmarked=(150,))
    (f[120] / rf.TRAINER_STATE).write_text(json.dumps({"step": 120, "images_seen": 7680}))  # evals need the step only
    opened = rf.open_checkpoint(f[120])
    assert opened == rf.OpenCheckpoint(f[120], 120)
    assert opened.weights == f[120] / "model.safetensors"
    assert rf.open_checkpoint(f[130]).step is None  # no trainer state: the caller supplies the step
    (f[140] / rf.TRAINER_STATE).write_text(json.dumps({"step": "x"}))
    with pytest.raises(ValueError, match=r"trainer_state\.json does not record the checkpoint's step"):
        rf.open_checkpoint(f[140])
    with pytest.raises(rf.IncompleteCheckpointError, match="step_00000150 has no COMPLETE marker"):
        rf.open_checkpoint(f[150])


def test_what_looks_like_a_training_checkpoint(tmp_path):
    f = _folders(tmp_path, complete=(1,), unmarked=(2, 3))
    (f[3] / rf.WEIGHTS_FILE).write_text("")  # a step_N folder with weights but no trainer files: exported weights
    half = tmp_path / "half"
    half.mkdir()
    (half / rf.TRAINER_STATE).write_text("{}")
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / rf.WEIGHTS_FILE).write_text("")
    looks = {p.name: rf.looks_like_checkpoint(p) for p in (f[1], f[2], f[3], half, exported, tmp_path / "gone")}
    assert looks == {
        "step_00000001": True,
        "step_00000002": True,
        "step_00000003": False,
        "half": True,
        "exported": False,
        "gone": False,
    }


def test_publish_renames_then_marks_and_replaces_an_unmarked_folder(tmp_path):
    _folders(tmp_path, staging=(4,))
    staging = rf.staging_dir(tmp_path, 8)
    rf.start_staging(staging)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000008.tmp"]
    _folders(tmp_path, unmarked=(8,))
    (staging / "payload").write_text("new")
    final = rf.publish(staging)
    assert final == rf.checkpoint_dir(tmp_path, 8) and not staging.exists()
    assert (final / rf.COMPLETE).read_text() == "8\n" and (final / "payload").read_text() == "new"
    with pytest.raises(ValueError, match="not a staging folder"):
        rf.publish(final)


def test_prune_keeps_the_newest_and_pinned_ones(tmp_path):
    f = _folders(tmp_path, complete=(10, 20, 30, 40), unmarked=(50,))
    assert rf.pin_checkpoint(f[10], "evals pending")
    assert rf.prune_checkpoints(tmp_path, keep_last=2) == [f[20]]
    assert rf.complete_checkpoints(tmp_path) == [f[10], f[30], f[40]] and f[50].is_dir()  # unmarked: not ours
    assert rf.pinned_checkpoints(tmp_path) == [f[10]]
    rf.unpin_checkpoint(f[10])
    rf.unpin_checkpoint(f[10])  # idempotent
    assert rf.pinned_checkpoints(tmp_path) == []
    assert rf.prune_checkpoints(tmp_path, keep_last=2) == [f[10]]
    assert not rf.pin_checkpoint(f[20], "evals pending") and not f[20].exists()  # pruned: nothing recreated


def test_prune_after_a_save_counts_only_the_checkpoints_up_to_its_step(tmp_path):
    # A resume that skipped a damaged step-40 checkpoint saves step 20: that save is the newest of its run.
    f = _folders(tmp_path, complete=(10, 20, 40))
    assert rf.prune_checkpoints(tmp_path, keep_last=1, upto=20) == [f[10]]
    assert rf.complete_checkpoints(tmp_path) == [f[20], f[40]]


# A run_folder function (a folder, then integers) in a fresh interpreter, killed (os._exit, as by SIGKILL) at its
# Nth removal of a file or folder.
KILLED_AT_REMOVAL = """
import os, sys
from pathlib import Path
from pretrain.checkpoint import run_folder
removals = 0
def kill_at_removal(event, args):
    global removals
    if event in ("os.remove", "os.rmdir"):
        removals += 1
        if removals == int(sys.argv[1]):
            os._exit(9)
sys.addaudithook(kill_at_removal)
getattr(run_folder, sys.argv[2])(Path(sys.argv[3]), *map(int, sys.argv[4:]))
"""


def _killed_at_removal(n: int, function: str, *args: str) -> bool:
    """Whether the kill came before ``function`` returned."""
    command = [sys.executable, "-c", KILLED_AT_REMOVAL, str(n), function, *args]
    done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 9), done.stderr
    return done.returncode == 9


FILES = ["checksums.json", "deepspeed/optim_states.pt", "model.safetensors", "trainer_state.json"]


def _checkpoint_files(folder: Path, text: str) -> None:
    (folder / "deepspeed").mkdir(parents=True)
    for name in FILES:
        (folder / name).write_text(text)


def test_a_save_of_the_same_step_killed_while_it_deletes_the_old_folder_leaves_no_complete_partial_one(tmp_path):
    """A resume that skipped a damaged step-8 checkpoint saves step 8 again: the old folder is deleted first. Killed
    during that delete, it must not be left COMPLETE with files missing (without checksums.json, loaded unverified)."""
    for n in range(1, 20):
        run = tmp_path / str(n)
        old = _folders(run, complete=(8,))[8]
        _checkpoint_files(old, "old")
        staging = rf.staging_dir(run, 8)
        _checkpoint_files(staging, "new")
        if not _killed_at_removal(n, "publish", str(staging)):
            break
        for folder in rf.complete_checkpoints(run):
            kept = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
            assert kept == sorted([*FILES, "COMPLETE", "deepspeed"]), (n, kept)
    else:
        pytest.fail("publish was killed at every removal")
    assert (rf.checkpoint_dir(run, 8) / "model.safetensors").read_text() == "new"


def test_the_next_save_removes_what_an_interrupted_prune_or_publish_left(tmp_path):
    """A prune killed while it deletes leaves an unmarked folder of an old step, which no save writes again; each
    was a whole checkpoint's disk (12 GB for an H/14) for the rest of the run."""
    f = _folders(tmp_path, complete=(10, 20, 30))
    _checkpoint_files(f[10], "old")
    assert _killed_at_removal(2, "prune_checkpoints", str(tmp_path), "2")
    assert f[10].is_dir() and rf.complete_checkpoints(tmp_path) == [f[20], f[30]]
    renamed = _folders(tmp_path, unmarked=(40,))[40]  # killed between publish's rename and its COMPLETE
    staging = rf.staging_dir(tmp_path, 50)
    rf.start_staging(staging)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000020",
        "step_00000030",
        "step_00000050.tmp",
    ]
    assert not renamed.exists()
