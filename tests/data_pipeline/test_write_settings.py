"""What a shard folder's `_write_settings.json` makes the same run: the same input by any path or cwd, any
--processes; what differs is refused in one line that names it. Real images, real writer runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline import manifest
from data_pipeline.write import __main__ as write_cli
from tests.data_pipeline.test_tfds import IMAGE, class_label, jpeg, make_tfds
from tests.data_pipeline.test_write import class_tars, encoded, smooth_image

FIX = "Run with what it was written with to go on from them, or choose a new --out or delete it"


def folder_tree(root: Path, classes=("cat", "dog"), per_class: int = 6) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"{i}.jpg").write_bytes(encoded(smooth_image(10 * c + i), quality=92))
    return root


def tar_tree(root: Path) -> Path:
    return class_tars(root, ["n01", "n02"], per_class=6)


def parquet_tree(root: Path) -> Path:
    root.mkdir(parents=True)
    images = [{"bytes": encoded(smooth_image(200 + i)), "path": None} for i in range(12)]
    pq.write_table(pa.table({"image": images, "label": [i % 3 for i in range(12)]}), root / "part.parquet")
    return root


def tfds_tree(root: Path) -> Path:
    records = [{"image": [jpeg(k)], "label": [k % 3]} for k in range(12)]
    return make_tfds(
        root / "1.0.0", "toy", {"train": [records[:7], records[7:]]}, {"image": IMAGE, "label": class_label(3)}
    )


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def write(source: str, out: str, *more: str) -> int:
    return write_cli.main(["--source", source, "--out", out, "--samples-per-shard", "4", "--processes", "1", *more])


def interrupt(out: Path) -> dict[str, int]:
    """Leave ``out`` as a run stopped in its last shard leaves it (finished shards and settings, no metadata); the
    kept shards' mtimes."""
    last = max(out.glob("shard-*.tar"))
    for file in out.iterdir():
        if file == last or file.suffix != ".tar" and file.name != manifest.WRITE_SETTINGS_FILE:
            file.unlink()
    return {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["folder", "tars", "parquet", "tfds"])
def test_the_same_input_by_another_path_cwd_or_copy_is_the_same_run(tmp_path, monkeypatch, capsys, kind):
    """Written by a path relative to the cwd, interrupted, then re-run by the absolute path, from another cwd and
    from a copy elsewhere: each keeps the finished shards, and the folder is byte for byte an uninterrupted run's."""
    make = {"folder": folder_tree, "tars": tar_tree, "parquet": parquet_tree, "tfds": tfds_tree}[kind]
    base = tmp_path / "work" / "imgs"
    src = make(base)  # the tfds version folder is below it
    copy = shutil.copytree(base, tmp_path / "elsewhere" / "imgs") / src.relative_to(base)
    prefix = "tfds:" if kind == "tfds" else ""
    assert write(prefix + str(src), str(tmp_path / "clean")) == 0
    monkeypatch.chdir(tmp_path / "work")
    assert write(prefix + str(src.relative_to(tmp_path / "work")), "out") == 0
    out = tmp_path / "work" / "out"
    for source, cwd in [(src, tmp_path), (src.relative_to(tmp_path), tmp_path), (copy, tmp_path / "elsewhere")]:
        kept = interrupt(out)
        monkeypatch.chdir(cwd)
        assert write(prefix + str(source), str(out)) == 0, capsys.readouterr().err
        assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # kept, not written again
        assert files(out) == files(tmp_path / "clean")


@pytest.mark.timeout(120)
def test_source_dot_names_the_folder_and_is_the_same_run_as_its_path(tmp_path, monkeypatch, capsys):
    """`--source .` named the dataset "" (Path(".").name); it names the folder, so the same run by its path."""
    src = folder_tree(tmp_path / "imgs")
    monkeypatch.chdir(src)
    assert write(".", str(tmp_path / "out")) == 0
    assert json.loads((tmp_path / "out" / "dataset.json").read_text())["name"] == "imgs"
    monkeypatch.chdir(tmp_path)
    kept = interrupt(tmp_path / "out")
    assert write("imgs", "out") == 0, capsys.readouterr().err
    assert {n: (tmp_path / "out" / n).stat().st_mtime_ns for n in kept} == kept


@pytest.mark.timeout(120)
def test_processes_is_not_a_setting_the_shards_depend_on(tmp_path, capsys):
    """1 and 2 processes write the same bytes, every file; so a re-run with another count is the same run."""
    src = folder_tree(tmp_path / "imgs", classes=("a", "b", "c"))
    for n in ("1", "2"):
        args = ["--source", str(src), "--out", str(tmp_path / n), "--samples-per-shard", "3", "--processes", n]
        assert write_cli.main([*args, "--max-short-side", "16"]) == 0
    assert files(tmp_path / "1") == files(tmp_path / "2")
    assert "processes" not in json.loads((tmp_path / "1" / manifest.WRITE_SETTINGS_FILE).read_text())
    kept = interrupt(tmp_path / "1")
    args = ["--source", str(src), "--out", str(tmp_path / "1"), "--samples-per-shard", "3", "--processes", "2"]
    assert write_cli.main([*args, "--max-short-side", "16"]) == 0, capsys.readouterr().err
    assert {n: (tmp_path / "1" / n).stat().st_mtime_ns for n in kept} == kept
    assert files(tmp_path / "1") == files(tmp_path / "2")


@pytest.mark.timeout(120)
def test_a_refusal_names_what_differs_and_the_fix(tmp_path, capsys):
    src = folder_tree(tmp_path / "imgs")
    out = tmp_path / "out"
    assert write(str(src), str(out)) == 0
    before = files(out)
    other = folder_tree(tmp_path / "other" / "imgs", classes=("cat", "fox"))
    names = tmp_path / "names.txt"
    names.write_text("cat\tfelis\ndog\tcanis\n")
    for more, what in [
        (["--seed", "9"], "--seed 0 then, 9 now"),
        (["--seed", "9", "--max-short-side", "64"], "--max-short-side 512 then, 64 now; --seed 0 then, 9 now"),
        (["--name", "pets"], '--name "imgs" then, "pets" now'),
        (["--keep-exact-duplicates"], "--keep-exact-duplicates false then, true now"),
        (["--class-names", str(names)], "the class names (--class-names, a labels file or the class folders' names)"),
        (
            ["--source", str(other), "--name", "imgs"],
            "the source's class folders or files (dog then only; fox now only)",
        ),
    ]:
        capsys.readouterr()
        assert write(str(src), str(out), *more) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err == "python -m data_pipeline.write: error: "
            f"{out} holds shards written with other settings or input: {what}. {FIX}"
        )
        assert files(out) == before  # nothing written, nothing lost


def legacy(out: Path, settings: dict, source_as_given: str, digest: bool) -> None:
    """Record ``settings`` as the previous version wrote them: no format or class names, --processes null, the class
    folders as the paths given, and (before 2026-12-06) no input digest."""
    settings = dict(settings)
    for key in ("format", "class_names", *(() if digest else ("input",))):
        settings.pop(key, None)
    settings["processes"] = None
    settings["source"] = [str(Path(source_as_given) / name) for name in settings["source"]]
    (out / manifest.WRITE_SETTINGS_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True))


@pytest.mark.timeout(120)
def test_a_folder_of_the_previous_format_is_accepted_by_another_path_or_refused_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """With its input digest it is the same run by any path (and is rewritten in the new format); without one,
    only the paths as given keep its guarantee, and another spelling is refused naming them."""
    src = folder_tree(tmp_path / "imgs")
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    assert write("imgs", "out") == 0
    clean = files(out)
    settings = json.loads(clean[manifest.WRITE_SETTINGS_FILE])
    legacy(out, settings, "imgs", digest=True)
    kept = interrupt(out)
    assert write(str(src), str(out)) == 0, capsys.readouterr().err
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept and files(out) == clean  # format 2 again
    legacy(out, settings, "imgs", digest=True)
    assert write(str(src), str(out), "--seed", "1") == 2
    assert "--seed 0 then, 1 now" in capsys.readouterr().err
    legacy(out, settings, "imgs", digest=False)
    assert write(str(src), str(out)) == 2
    err = capsys.readouterr().err.strip()
    paths = f"imgs/cat, imgs/dog then; {src}/cat, {src}/dog now"
    assert err.endswith(f"--source's paths ({paths}), as an older version recorded them. {FIX}")
    assert "\n" not in err
    assert write("imgs", "out") == 0  # as given then: accepted, as before


@pytest.mark.timeout(120)
def test_exclude_like_and_class_names_by_another_path_or_copy_are_the_same_run(tmp_path, monkeypatch, capsys):
    """Neither is recorded by its path: their effect is (the input digest, the class names' digest)."""
    src = folder_tree(tmp_path / "imgs", per_class=7)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "e.jpg").write_bytes((src / "dog" / "3.jpg").read_bytes())
    (tmp_path / "names.txt").write_text("cat\tfelis\ndog\tcanis\n")
    monkeypatch.chdir(tmp_path)
    assert write("imgs", "out", "--exclude-like", "eval", "--class-names", "names.txt") == 0
    assert "excluded 1" in capsys.readouterr().out
    clean = files(tmp_path / "out")
    elsewhere = shutil.copytree(tmp_path / "eval", tmp_path / "b" / "eval2")
    shutil.copy(tmp_path / "names.txt", tmp_path / "b" / "n.txt")
    kept = interrupt(tmp_path / "out")
    monkeypatch.chdir(tmp_path / "b")
    more = ["--exclude-like", str(elsewhere), "--class-names", "n.txt"]
    assert write(str(src), str(tmp_path / "out"), *more) == 0, capsys.readouterr().err
    assert {n: (tmp_path / "out" / n).stat().st_mtime_ns for n in kept} == kept
    assert files(tmp_path / "out") == clean
