"""Ctrl-C in the long-running `python -m data_pipeline.*` commands: real processes sent SIGINT while they work, as a
terminal sends it to its whole foreground process group (the command and its worker processes): exit 130, one line
on stderr saying what is kept and how to go on, no traceback, no process left behind; and what the line says holds."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_pipeline import manifest
from data_pipeline.builtin import sets as builtin
from data_pipeline.write import __main__ as write_cli
from tests.support.interrupt import PROJECT, assert_one_line, ctrl_c


def _big_jpegs(root: Path, per_class: int) -> Path:
    """3 classes of large JPEGs: each is decoded, downscaled and re-encoded, so a shard takes a while to write."""
    for c in range(3):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            small = np.random.default_rng([c, i]).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
            out = io.BytesIO()
            Image.fromarray(small).resize((1200, 900), Image.Resampling.BICUBIC).save(out, "JPEG", quality=95)
            (root / f"class{c}" / f"{i}.jpg").write_bytes(out.getvalue())
    return root


@pytest.mark.timeout(120)
def test_ctrl_c_in_the_writer_keeps_its_finished_shards_and_the_same_command_finishes_the_folder(tmp_path):
    """Ctrl-C with 2 worker processes writing: one line (not a traceback per process) that says how many finished
    shards are kept; the same command then writes the rest, and the folder equals an uninterrupted write's."""
    source = _big_jpegs(tmp_path / "src", per_class=30)
    args = ["--source", str(source), "--samples-per-shard", "2", "--max-short-side", "32", "--processes", "2"]
    assert write_cli.main([*args, "--out", str(tmp_path / "clean")]) == 0
    out = tmp_path / "out"
    command = [sys.executable, "-m", "data_pipeline.write", *args, "--out", str(out)]
    done = ctrl_c(command, lambda _: any(out.glob(manifest.SHARD_GLOB)), tmp_path)

    line = assert_one_line(done, "python -m data_pipeline.write")
    assert done.processes >= 3  # the command and its pool's workers all got the signal
    kept = sorted(p.name for p in out.glob(manifest.SHARD_GLOB))
    assert 1 <= len(kept) < 45 and not (out / "manifest.parquet").exists()
    said = f"the {len(kept)} finished shards in {out} are kept; the same command goes on from them"
    assert line == f"python -m data_pipeline.write: interrupted; {said}\n"
    stamps = {name: (out / name).stat().st_mtime_ns for name in kept}

    again = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=90)
    assert again.returncode == 0, again.stderr
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == stamps  # kept, not written again
    clean = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert clean == sorted(p.name for p in out.iterdir())
    for name in clean:  # the manifest and every shard, byte for byte
        assert (tmp_path / "clean" / name).read_bytes() == (out / name).read_bytes(), name


def _generating(root: Path) -> Callable[[Path], bool]:
    """Ready once both generator processes (spawned, so Python processes of their own) are at work."""
    since: list[float] = []

    def ready(_: Path) -> bool:
        if not since and (root / "rcdb" / ".generate.lock").exists():
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] > 1.5  # past the workers' start: at work on images

    return ready


@pytest.mark.timeout(120)
def test_ctrl_c_while_built_in_images_are_generated_stops_the_workers_at_once(tmp_path):
    """Ctrl-C while `--workers 2` generate images: the pool used to wait for the task its dying worker had taken, so
    the command hung (a second Ctrl-C then printed tracebacks). Now one line, exit 130, and the same command writes
    the whole set."""
    root = tmp_path / "data"
    command = [sys.executable, "-m", "data_pipeline.builtin", "rcdb", "--out", str(root), "--workers", "2"]
    done = ctrl_c(command, _generating(root), tmp_path, wait_s=20)

    line = assert_one_line(done, "python -m data_pipeline.builtin")
    assert done.processes >= 3 and not (root / "rcdb" / "train" / "dataset.json").exists()
    assert line.endswith(f"the sets and shards finished under {root} are kept; the same command goes on from them\n")
    again = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=90)
    assert again.returncode == 0, again.stderr
    assert builtin.check_folder("rcdb", root)


def test_spawned_workers_ignore_a_ctrl_c_that_comes_while_their_interpreter_starts():
    """Ctrl-C reaches the whole process group. A spawned pool worker ignored it only once its initializer ran, after
    its interpreter's start-up: one hit before died printing "Fatal Python error: init_import_site" (seen in the
    built-in generator's Ctrl-C test on a loaded machine). Now it inherits SIGINT ignored across exec."""
    import multiprocessing
    import os
    import signal

    from data_pipeline.cli import spawned_pool

    before = set(multiprocessing.active_children())
    pool = spawned_pool(2)
    try:
        workers = [p for p in multiprocessing.active_children() if p not in before]
        for worker in workers:  # at once: their interpreters are still starting
            os.kill(worker.pid, signal.SIGINT)
        assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
        assert len(workers) == 2 and all(w.exitcode is None for w in workers)  # none died and was replaced
    finally:
        pool.terminate()
        pool.join()


def test_ranks_printing_their_error_at_once_leave_whole_lines(tmp_path):
    """Every rank prints the same error to one terminal or log (torchrun's, a job's): stderr is unbuffered, and
    print's two writes (the text, then the newline) interleaved, `...move this one awaypython -m ...`."""
    start = time.time() + 2  # all four print at once
    script = (
        f"import time\nfrom data_pipeline.cli import fail\ntime.sleep(max(0, {start} - time.time()))\n"
        "for i in range(2000): fail('python -m x', 'bad input')"
    )
    with open(tmp_path / "log", "w") as log:
        ranks = [subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT, stderr=log) for _ in range(4)]
        assert [rank.wait(timeout=60) for rank in ranks] == [0] * 4
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 8000 and set(lines) == {"python -m x: error: bad input"}
