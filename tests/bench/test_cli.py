"""What every `python -m bench.*` command does around its measuring, shown on the quickest one (`bench.precision
--shapes quick`): an --out it cannot write is refused before the minutes of timing, Ctrl-C is one line, and the
results file is replaced whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from bench.precision import main
from tests.support.interrupt import PROJECT, assert_one_line, ctrl_c

QUICK = [sys.executable, "-m", "bench.precision", "--shapes", "quick", "--trials", "1"]


def test_an_out_that_cannot_be_written_is_refused_before_measuring(capsys):
    assert main(["--shapes", "quick", "--out", "/proc/bench-precision.json"]) == 2  # /proc takes no new file
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "python -m bench.precision: error: --out /proc/bench-precision.json: "
    )
    assert "cannot write in /proc" in err and "writable folder" in err


@pytest.mark.timeout(120)
def test_ctrl_c_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "precision.json"
    done = ctrl_c([*QUICK, "--out", str(out)], lambda stdout: "ms" in stdout.read_text(), tmp_path)
    assert assert_one_line(done, "python -m bench.precision") == (
        f"python -m bench.precision: interrupted; nothing was written to {out}; the same command starts over\n"
    )
    assert not list(tmp_path.glob("precision.json*"))


@pytest.mark.timeout(120)
def test_a_write_that_fails_leaves_the_previous_results_whole(tmp_path):
    """A full disk, as a file-size limit: the previous JSON stays as it was, not cut short, and no scratch file."""
    out = tmp_path / "precision.json"
    out.write_text('{"previous": 1}\n')
    limit = "import resource, runpy, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit("
    limit += "resource.RLIMIT_FSIZE, (64, 64)); runpy.run_module('bench.precision', run_name='__main__')"
    command = [sys.executable, "-c", limit, *QUICK[3:], "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert out.read_text() == '{"previous": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["precision.json"]


def _stderr_has(text: str):
    return lambda stdout: text in (stdout.parent / "stderr.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("module", "args", "ready"),
    [
        ("bench.data", "--images 80 --size 64", lambda stdout: "generated JPEGs" in stdout.read_text()),
        (
            "bench.train",
            "--models vit_ti16 --precisions fp32 --batch-size 2 --rounds 99 --repeats 1 --no-eager --no-compile",
            _stderr_has("round 1/"),
        ),
        (
            "bench.scaling",
            "--model vit_tiny_debug --image-size 32 --steps 40 --log-every 1 --rounds 1",
            _stderr_has("world 1 on cores"),
        ),
    ],
)
def test_ctrl_c_in_every_benchmark_is_its_last_line_and_leaves_no_process(tmp_path, module, args, ready):
    """Its progress lines, then the one line; no process of it left, the training ranks of bench.scaling too."""
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "out.json"
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMP_NUM_THREADS": "1"}
    done = ctrl_c([sys.executable, "-m", module, *args.split(), "--out", str(out)], ready, tmp_path, env=env)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.endswith(
        f"python -m {module}: interrupted; nothing was written to {out}; the same command starts over\n"
    )
    time.sleep(1)
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not out.exists() and not list((tmp_path / "tmp").glob("bench-*"))
