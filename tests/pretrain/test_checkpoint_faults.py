"""Faults that are not a clean kill, on real DeepSpeed (2 processes under torchrun, CPU, gloo) and real files:

- a checkpoint records each file's size and CRC-32 (``checksums.json``); a file cut short in the newest COMPLETE
  checkpoint is skipped with one line naming it, and the run resumes from the one before, equal to the uninterrupted
  run at every later step (bit-identical);
- one byte flipped in the middle of an optimizer state file is found and the checkpoint skipped; an eval refuses a
  checkpoint whose weights changed; ``python -m pretrain.checkpoint verify`` exits 0 / 2 and prints a line each;
- a save into a full filesystem (a real tmpfs, mounted in a mount namespace of the test's own: the machine runs the
  tests as root; skipped where mounting is not allowed) leaves the earlier checkpoints intact and loadable, removes
  its staging folder and stops the run with one message naming the path and the space; the run then resumes exactly;
- without a process group: a write into /dev/full (the kernel's ENOSPC) is recorded, not raised; the
  ``on_save_error`` policy; the plan's free-space warning.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cluster.local_head import free_port
from pretrain import checkpointer as ckpt
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.writes import CheckpointSaveError, SaveAttempt, failure_message, folder_bytes
from pretrain.config.train_config import load_config
from tests.pretrain.test_train_distributed import _env, _run, shared_torchrun, tiny_config, torchrun
from tests.support import warm_ranks

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ("deepspeed.zero_stage=2", "model.dropout=0.1", "checkpoint.every_steps=2", "checkpoint.keep_last=4")
OPTIM_FILE = "deepspeed/step_00000008/zero_pp_rank_0_mp_rank_00_optim_states.pt"


# --------------------------------------------------------------------------------------------- fast: no DeepSpeed


def _files(folder: Path, sizes: dict[str, int]) -> dict[str, tuple[int, str]]:
    for name, size in sizes.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    return {name: checksums.entry(folder / name) for name in sizes}


def test_checksums_find_a_missing_a_short_and_a_changed_file(tmp_path):
    entries = _files(tmp_path, {"a.pt": 5000, "sub/b.pt": 3000, "c.json": 10})
    checksums.write(tmp_path, entries)
    assert checksums.expected(tmp_path) == entries
    assert checksums.verify(tmp_path).line() == f"{tmp_path}: verified (3 files, 0.0 MB)"
    with open(tmp_path / "a.pt", "r+b") as f:  # one byte in the middle
        f.seek(2500)
        byte = f.read(1)
        f.seek(2500)
        f.write(bytes([byte[0] ^ 0x01]))
    with open(tmp_path / "sub/b.pt", "r+b") as f:
        f.truncate(1500)
    (tmp_path / "c.json").unlink()
    verdict = checksums.verify(tmp_path)
    assert verdict.status == "damaged" and not verdict.ok
    assert verdict.problems == (
        f"a.pt has crc32 {checksums.entry(tmp_path / 'a.pt')[1]}, {entries['a.pt'][1]} was written (its bytes changed)",
        "c.json is missing",
        "sub/b.pt has 1500 bytes, 3000 were written",
    )
    assert verdict.problem.endswith("(and 2 more files)")
    assert checksums.verify(tmp_path, only=["c.json"]).problems == ("c.json is missing",)
    (tmp_path / run_folder.CHECKSUMS).write_text('{"algorithm": "crc32", "files": {"a.pt": [1')  # cut short
    assert "checksums.json is unreadable (JSONDecodeError" in checksums.verify(tmp_path).problem
    (tmp_path / run_folder.CHECKSUMS).unlink()
    assert checksums.verify(tmp_path).status == "unverified"  # an older checkpoint: it loads


def test_a_checksum_record_that_cannot_be_read_is_one_line_of_verify_not_a_traceback(tmp_path):
    """A read error (EIO from failing storage): /proc/self/mem is a regular file whose first page no process maps, so
    reading it fails with the kernel's EIO."""
    folder = run_folder.checkpoint_dir(tmp_path, 2)
    folder.mkdir(parents=True)
    (folder / run_folder.COMPLETE).write_text("2\n")
    (folder / run_folder.CHECKSUMS).symlink_to("/proc/self/mem")
    verdict = checksums.verify(folder)
    assert verdict.status == "damaged" and verdict.problem == "checksums.json cannot be read (Input/output error)"
    done = _verify_cli(tmp_path)
    assert done.returncode == 2 and done.stderr == "", done.stderr
    assert done.stdout == f"{folder}: DAMAGED: checksums.json cannot be read (Input/output error)\n"


@pytest.mark.timeout(120)
def test_a_run_folder_verify_may_not_list_is_one_line_not_a_traceback(tmp_path):
    """A run folder whose checkpoints/ the user running verify may not list (another user's). Root lists anything, so
    there verify runs as nobody, in a fork of this process: a `python -m` as nobody failed to import the project
    from a checkout nobody may read (a home folder of mode 0750, a fresh clone under a 0700 temp folder)."""
    from pretrain.checkpoint.__main__ import main

    with tempfile.TemporaryDirectory() as top:  # not under tmp_path: /tmp/pytest-of-root is root's alone
        os.chmod(top, 0o711)
        run = Path(top) / "run"
        folder = run_folder.checkpoint_dir(run, 2)
        folder.mkdir(parents=True)
        (folder / run_folder.COMPLETE).write_text("2\n")
        os.chmod(run_folder.checkpoints_dir(run), 0o300)  # its owner may not list it either
        with open(tmp_path / "stderr", "w") as err, open(tmp_path / "stdout", "w") as out:
            pid = os.fork()
            if pid == 0:  # the child: nothing of pytest's runs here, it leaves through os._exit
                status = 3
                try:
                    if os.geteuid() == 0:
                        os.setgroups([])
                        os.setgid(65534)
                        os.setuid(65534)
                    sys.stdout, sys.stderr = out, err
                    status = main(["verify", str(run)])
                    out.flush()
                    err.flush()
                finally:
                    os._exit(status)
            status = _wait(pid, 60)
    printed = (tmp_path / "stderr").read_text()
    assert status == 2 and (tmp_path / "stdout").read_text() == "", printed
    assert printed == (
        f"python -m pretrain.checkpoint: error: [Errno 13] Permission denied: '{run_folder.checkpoints_dir(run)}'\n"
    )


def _wait(pid: int, timeout_s: float) -> int:
    """The exit status of the child ``pid``, killed after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"verify did not end within {timeout_s:.0f} s")
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(done[1])


def test_the_ranks_shares_cover_every_file_once_and_balance_the_bytes():
    entries = {f"f{i}": (size, "0") for i, size in enumerate([900, 500, 400, 300, 300, 100, 50, 1])}
    shares = [checksums.share(entries, part, 3) for part in range(3)]
    assert sorted(name for s in shares for name in s) == sorted(entries)
    loads = [sum(size for size, _ in s.values()) for s in shares]
    assert max(loads) - min(loads) <= 100, loads
    verdicts = [checksums.Verdict(Path("x"), "verified", (), 2, 10), checksums.Verdict(Path("x"), "damaged", ("b",))]
    assert checksums.combine(Path("x"), verdicts).status == "damaged"


def test_a_write_into_a_full_device_is_recorded_not_raised(tmp_path):
    """/dev/full fails every write with ENOSPC (the kernel's, not a simulation); torch.save as DeepSpeed calls it."""
    staging = tmp_path / "run" / "checkpoints" / "step_00000006.tmp"
    staging.mkdir(parents=True)
    attempt = SaveAttempt(staging, rank=1)
    attempt.write(staging / "ok.pt", lambda: torch.save({"x": torch.ones(3)}, staging / "ok.pt"))
    assert attempt.failure is None and attempt.written == {"ok.pt": checksums.entry(staging / "ok.pt")}
    (staging / "full.pt").symlink_to("/dev/full")
    attempt.write(
        staging / "full.pt",
        lambda: torch.save({"x": torch.ones(10**6)}, str(staging / "full.pt"), _use_new_zipfile_serialization=False),
    )
    failure = attempt.failure
    assert failure is not None and failure.no_space and failure.rank == 1 and failure.path.endswith("full.pt")
    assert "No space left on device" in failure.error
    attempt.write(staging / "later.pt", lambda: (staging / "later.pt").write_text("x"))
    assert not (staging / "later.pt").exists()  # nothing more is written after the first failure
    # The message, as rank 0 writes it once the staging folder is gone.
    previous = run_folder.checkpoint_dir(tmp_path / "run", 4)
    checksums.write(previous, _files(previous, {"model.safetensors": 4000}))
    (previous / run_folder.COMPLETE).write_text("4\n")
    shutil.rmtree(staging)
    message = failure_message(failure, staging, 1234)
    assert message.startswith(f"checkpoint step_00000006 was not saved: no space left on device writing {failure.path}")
    assert "a checkpoint needs about 0.0 MB (the size of step_00000004)" in message
    assert f"{staging.parent} has " in message
    assert "the earlier checkpoints are intact (newest: step_00000004)" in message
    assert message.endswith("; free space (or lower checkpoint.keep_last)")
    # Any other failure (a permission, an I/O error) is not told to free space it has.
    denied = dataclasses.replace(failure, no_space=False, error="PermissionError: [Errno 13] Permission denied")
    message = failure_message(denied, staging, 1234)
    assert message == (
        f"checkpoint step_00000006 was not saved: a write failed writing {failure.path} (rank 1: PermissionError: "
        "[Errno 13] Permission denied); its partial files were removed and the earlier checkpoints are intact "
        f"(newest: step_00000004); make {staging.parent} writable again (its permissions, its mount)"
    )


def _trainer(config, step: int):
    stream = SimpleNamespace(state_dict=dict)
    return SimpleNamespace(
        engine=None, model=None, current=config, step=step, images_seen=0, stream=stream, place=SimpleNamespace(rank=0)
    )


def test_on_save_error_stops_or_skips_but_never_skips_the_last_save(tmp_path, monkeypatch, capsys):
    def full_disk(*args, **kwargs):
        raise CheckpointSaveError("checkpoint step_00000004 was not saved: no space left on device writing x")

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)
    stop = load_config("local_demo", [f"checkpoint.dir={tmp_path}", "checkpoint.every_steps=2"])
    with pytest.raises(CheckpointSaveError, match=r"launch the run again: .*on_save_error: stop\)$"):
        ckpt.Checkpointer(stop, last_step=9).after_step(_trainer(stop, 4), {})
    skip = stop.replace(checkpoint=dataclasses.replace(stop.checkpoint, on_save_error="skip"))
    checkpointer = ckpt.Checkpointer(skip, last_step=9)
    checkpointer.after_step(_trainer(skip, 4), {})  # trains on
    assert checkpointer.saved == []
    assert "training goes on (checkpoint.on_save_error: skip) and saves again at step 6" in capsys.readouterr().err
    with pytest.raises(CheckpointSaveError, match="the last checkpoint cannot be skipped"):
        checkpointer.after_step(_trainer(skip, 9), {})
    with pytest.raises(ValueError, match="on_save_error"):
        load_config("local_demo", ["checkpoint.on_save_error=retry"])


@pytest.mark.timeout(120)
def test_plan_warns_when_the_run_folder_cannot_hold_keep_last_plus_one_checkpoints(tmp_path):
    from cluster.plan.checkpoint_costs import CHECKPOINT_BYTES_PER_PARAM
    from cluster.plan.planner import build_plan, resolve_config
    from cluster.plan.text import format_plan
    from cluster.profiles import load_profile

    profile = load_profile("local")
    storage = dataclasses.replace(profile.storage, shards=str(tmp_path / "data"), checkpoints=str(tmp_path / "runs"))
    profile = dataclasses.replace(profile, storage=storage)
    plan = build_plan(profile, resolve_config(profile, "local_demo", [], "demo"))
    assert not any("checkpoint.keep_last" in w for w in plan.data.warnings)
    free = shutil.disk_usage(tmp_path).free
    keep = free // (plan.model.num_params * CHECKPOINT_BYTES_PER_PARAM) + 1  # one more than the disk holds
    plan = build_plan(profile, resolve_config(profile, "local_demo", [f"checkpoint.keep_last={keep}"], "demo"))
    (warning,) = [w for w in plan.data.warnings if "checkpoint.keep_last" in w]
    assert warning.startswith(f"{tmp_path / 'runs' / 'demo'} has ") and f"= {keep + 1} checkpoints of" in warning
    assert f"WARNING       {warning}" in format_plan(plan)


# --------------------------------------------------------------------------------------------- slow: 2 processes


@pytest.fixture
def uninterrupted(tiny_fractal_shards, shared_folder) -> tuple[Path, list[dict]]:
    """An uninterrupted 8-step run with checkpoints at steps 2, 4, 6, 8 (kept), and its rank summaries: trained once
    per pytest run for the tests below, which change only copies of it."""
    return shared_torchrun(shared_folder, tiny_fractal_shards, *EXTRA)


def _copy_run(run: Path, to: Path, drop: tuple[int, ...] = ()) -> Path:
    shutil.copytree(run, to)
    for step in drop:
        shutil.rmtree(run_folder.checkpoint_dir(to, step))
    return to


def _flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))


def _verify_cli(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain.checkpoint", "verify", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _assert_continues(resumed: list[dict], whole: list[dict], start: int) -> None:
    """Every rank started at ``start`` and its losses equal the uninterrupted run's, bit for bit, to the end."""
    for r, w in zip(resumed, whole, strict=True):
        assert r["start"] == "run" and r["start_step"] == start, r
        later = dict(w["losses"])
        assert [step for step, _ in r["losses"]] == list(range(start + 1, max(later) + 1))
        assert [loss for _, loss in r["losses"]] == [later[step] for step, _ in r["losses"]], (r, w)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_file_cut_short_in_the_newest_checkpoint_resumes_exactly_from_the_previous(
    uninterrupted, tiny_fractal_shards, tmp_path
):
    run, whole = uninterrupted
    assert checksums.verify(run_folder.checkpoint_dir(run, 8)).status == "verified"
    # The run as it stood when it was killed after step 6's checkpoint, with that checkpoint's engine file cut in half.
    split = _copy_run(run, tmp_path / "split", drop=(8,))
    damaged = run_folder.checkpoint_dir(split, 6) / "deepspeed" / "step_00000006" / "mp_rank_00_model_states.pt"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:
        f.truncate(size // 2)
    resumed = torchrun(tiny_config(tiny_fractal_shards, split, *EXTRA), tmp_path / "w")
    _assert_continues(resumed, whole, start=4)
    printed = (tmp_path / "w" / "output.log").read_text().splitlines()
    skipped = [line for line in printed if "skipping damaged checkpoint" in line]
    assert skipped == [
        f"skipping damaged checkpoint {run_folder.checkpoint_dir(split, 6)}: deepspeed/step_00000006/"
        f"mp_rank_00_model_states.pt has {size // 2} bytes, {size} were written; resuming from an older one"
    ]
    assert checksums.verify(run_folder.checkpoint_dir(split, 6)).status == "verified"  # saved again, whole


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_flipped_byte_is_found_skipped_and_refused_by_evals_and_verify(uninterrupted, tmp_path, capsys):
    from evals.runner import CheckpointError, open_checkpoint

    run, _ = uninterrupted
    flipped = _copy_run(run, tmp_path / "flipped")
    _flip_middle_byte(run_folder.checkpoint_dir(flipped, 8) / OPTIM_FILE)
    assert ckpt.newest_verified(flipped) == run_folder.checkpoint_dir(flipped, 6)  # what a resume starts from
    (line,) = capsys.readouterr().err.splitlines()
    newest = run_folder.checkpoint_dir(flipped, 8)
    assert line.startswith(f"skipping damaged checkpoint {newest}: {OPTIM_FILE} has crc32")
    assert line.endswith("was written (its bytes changed); resuming from an older one")
    # The CLI: one line per checkpoint, 2 on damage; 0 for an intact checkpoint.
    result = _verify_cli(flipped)
    assert result.returncode == 2, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [str(run_folder.checkpoint_dir(flipped, s)) for s in (2, 4, 6, 8)]
    assert all(line.endswith("MB)") and ": verified (" in line for line in lines[:3])
    assert lines[3].startswith(f"{run_folder.checkpoint_dir(flipped, 8)}: DAMAGED: {OPTIM_FILE} has crc32")
    good = _verify_cli(run_folder.checkpoint_dir(flipped, 6))
    assert good.returncode == 0 and good.stdout.count("\n") == 1 and ": verified (" in good.stdout
    for nothing in (tmp_path / "absent", tmp_path / "flipped" / "workers", ROOT / "configs"):
        bad = _verify_cli(nothing)
        assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad
        assert bad.stderr.startswith("python -m pretrain.checkpoint: error: ") and "Traceback" not in bad.stderr
    # An eval reads only the weights: a damaged optimizer state does not stop it, changed weights do.
    load_model, step, *_ = open_checkpoint(run_folder.checkpoint_dir(flipped, 8))
    assert step == 8
    _flip_middle_byte(run_folder.checkpoint_dir(flipped, 6) / run_folder.WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match=r"step_00000006 is damaged: model.safetensors has crc32 .* was written"):
        open_checkpoint(run_folder.checkpoint_dir(flipped, 6))
    # An older checkpoint (no checksums.json) is unverified: it loads, with a line saying so.
    (run_folder.checkpoint_dir(flipped, 4) / run_folder.CHECKSUMS).unlink()
    assert ckpt.newest_verified(flipped) == run_folder.checkpoint_dir(flipped, 4)
    assert "warning: resuming" in capsys.readouterr().err
    assert "unverified (no checksums.json" in _verify_cli(run_folder.checkpoint_dir(flipped, 4)).stdout


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    probe = ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


FULL_DISK_RUN = """
mount -t tmpfs -o size={size} tmpfs {run} || exit 99
trap 'kill -TERM $child; wait $child' TERM
{torchrun} &
child=$!
wait $child
code=$?
df -B1 --output=avail {run} | tail -1 > {work}/free_after
cp -a {run}/. {snapshot}/
exit $code
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_disk_keeps_the_earlier_checkpoints_and_stops_with_one_message(
    uninterrupted, tiny_fractal_shards, tmp_path
):
    if not _can_mount_tmpfs(tmp_path / "probe"):
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces); the /dev/full test covers the write")
    run, whole = uninterrupted
    # Room for two checkpoints and half of a third: keep_last=2 holds two, and the third save comes before the prune.
    blocks = sum(p.stat().st_blocks * 512 for p in run_folder.checkpoint_dir(run, 2).rglob("*") if p.is_file())
    size = int(2.5 * blocks) + (64 << 10)
    work, full, snapshot = tmp_path / "w", tmp_path / "full", tmp_path / "snapshot"
    for folder in (work, full, snapshot):
        folder.mkdir()
    config = tiny_config(tiny_fractal_shards, full, *EXTRA, "checkpoint.keep_last=2")
    config.save(work / "config.yaml")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "pretrain.train",
        "--config",
        str(work / "config.yaml"),
    ]
    script = FULL_DISK_RUN.format(size=size, run=full, work=work, snapshot=snapshot, torchrun=" ".join(command))
    result = _run(["unshare", "--mount", "sh", "-c", script], timeout=300)
    out = result.stdout
    (work / "output.log").write_text(out)  # what the ranks and torchrun printed
    assert result.returncode not in (0, 99), out[-4000:]
    messages = {line for line in out.splitlines() if "was not saved" in line}
    assert len(messages) == 1, messages  # every rank says the same one line
    message = messages.pop()
    assert "error: checkpoint step_00000006 was not saved: no space left on device writing " in message
    assert f"{full}/checkpoints/step_00000006.tmp/" in message and "(the size of step_00000004)" in message
    assert f"{full}/checkpoints has " in message
    assert "the earlier checkpoints are intact (newest: step_00000004)" in message
    assert message.endswith(
        "then launch the run again: it resumes from its newest checkpoint (checkpoint.on_save_error: stop)"
    )
    # torch's own words ("unexpected pos", "iostream error") only as the cause inside that line; no rank's traceback
    # (torchrun prints one of its own after the ranks exited with status 2)
    ranks_said = out.split("failed (exitcode: 2)")[0]
    assert "Traceback" not in ranks_said, out[-4000:]
    assert all("was not saved" in line for line in ranks_said.splitlines() if "pos" in line or "iostream" in line)
    # What the full disk held when the run stopped: no staging folder, the two earlier checkpoints intact.
    names = sorted(p.name for p in (snapshot / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000004"], names
    assert int((work / "free_after").read_text()) >= folder_bytes(run_folder.checkpoint_dir(run, 2)) // 2
    assert _verify_cli(snapshot).returncode == 0
    # Resumed with room to spare, it continues exactly where the uninterrupted run was.
    resumed = torchrun(tiny_config(tiny_fractal_shards, snapshot, *EXTRA), tmp_path / "r")
    _assert_continues(resumed, whole, start=4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_damaged_checkpoint_at_another_world_size_stops_every_rank_with_one_line(
    uninterrupted, tiny_fractal_shards, tmp_path
):
    """A checkpoint without checksums.json (written before checkpoints recorded them) whose optimizer file is cut
    short, or missing, resumed at another world size: rank 0 finds the damage while converting it, and every rank
    stops with the same line (or is ended by torchrun once another has). The others waited in a barrier for rank 0:
    they died of its exit with gloo's "Connection closed by peer" (a traceback), and on NCCL, or under Ray Train where
    a failed worker's process lives on, they waited for the collective timeout (30 minutes)."""
    run, _ = uninterrupted
    old = _copy_run(run, tmp_path / "old", drop=(6, 8))
    for step in (2, 4):
        (run_folder.checkpoint_dir(old, step) / run_folder.CHECKSUMS).unlink()
    work = tmp_path / "w"
    work.mkdir()
    tiny_config(tiny_fractal_shards, old, *EXTRA).save(work / "config.yaml")

    def errors_at_world_size_4() -> list[str]:
        log = work / "output.log"
        log.write_text("")
        status = warm_ranks.launch("pretrain.train", ["--config", str(work / "config.yaml")], 4, _env(), log, 240)
        printed = log.read_text()
        assert status == 1 and "Traceback" not in printed, printed[-4000:]
        lines = [line for line in printed.splitlines() if line.startswith("python -m pretrain.train: error: ")]
        # torchrun ends the other ranks once one has exited, so a rank may be stopped before it prints its line
        assert 1 <= len(lines) <= 4 and len(set(lines)) == 1, "\n".join(lines)
        return lines

    step4 = run_folder.checkpoint_dir(old, 4)
    cut = step4 / OPTIM_FILE.replace("08", "04")
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    lines = errors_at_world_size_4()
    assert lines[0].startswith(f"python -m pretrain.train: error: {cut} cannot be loaded (")
    assert not (step4 / "universal").exists()
    # A partition file missing: the converter's own error, as one line naming the checkpoint and the way on.
    shutil.rmtree(step4)
    step2 = run_folder.checkpoint_dir(old, 2)
    (step2 / "deepspeed/step_00000002/zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    lines = errors_at_world_size_4()
    assert lines[0].startswith(
        f"python -m pretrain.train: error: {step2}/deepspeed/step_00000002 cannot be converted for world size 4 ("
    )
    assert "resume it at the world size that saved it (2)" in lines[0]
    assert sorted(p.name for p in step2.iterdir() if p.name.startswith("universal")) == []


def test_a_universal_loads_steps_go_where_a_fused_adamw_reads_them():
    """DeepSpeed's universal loader leaves each Adam step on the host as it was saved; a fused AdamW (a GPU's) reads
    it on the parameter's device as float32, where torch's load_state_dict puts it. "meta" stands in for the GPU."""
    from pretrain.checkpointer import place_steps

    params = [torch.nn.Parameter(torch.empty(3, device="meta")) for _ in range(2)]
    shared = torch.tensor(7.0, dtype=torch.float64)  # ZeRO-3's one step tensor for every group
    for fused in (False, True):
        optimizer = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]]}])
        for group in optimizer.param_groups:
            group["fused"] = fused  # AdamW refuses fused=True for a meta tensor at construction
        for p in params:
            optimizer.state[p].update(step=shared, exp_avg=torch.empty(3, device="meta"))
        place_steps(optimizer)
        steps = [optimizer.state[p]["step"] for p in params]
        kind = ("meta", torch.float32) if fused else ("cpu", torch.float64)
        assert all((s.device.type, s.dtype) == kind for s in steps)
        assert len({id(s) for s in [shared, *steps]}) == 3  # the groups no longer count one tensor up twice a step
