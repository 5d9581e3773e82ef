"""The shard writer: readers, validation, dedup, exclusion, global shuffle, atomic and byte-identical re-runs."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import ExifTags, Image

from data_pipeline import manifest
from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.validate import validate
from data_pipeline.write import __main__ as write_cli
from data_pipeline.write import writer
from data_pipeline.write.dedup import load_exclusion, sha256_hex
from data_pipeline.write.readers import open_source


def smooth_image(seed: int, size=(40, 30)) -> Image.Image:
    """A smooth random image: distinct per seed, and its perceptual hash survives re-encoding."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    return Image.fromarray(small).resize(size, Image.BICUBIC)


def encoded(img: Image.Image, fmt="JPEG", **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


def class_tars(root: Path, wnids: list[str], per_class: int) -> Path:
    """``root`` in the ImageNet-21k layout: one plain tar per class, ``<wnid>.tar`` of ``<wnid>_<i>.JPEG``."""
    root.mkdir(parents=True)
    for c, wnid in enumerate(wnids):
        with tarfile.open(root / f"{wnid}.tar", "w") as tar:
            for i in range(per_class):
                data = encoded(smooth_image(50 + 10 * c + i))
                info = tarfile.TarInfo(f"{wnid}_{i}.JPEG")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return root


@pytest.fixture()
def folder_source(tmp_path):
    """3 classes x 6 good JPEGs, plus one of each kind of trouble, with known counts."""
    root = tmp_path / "src"
    for c in range(3):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(6):
            (d / f"img{i}.jpg").write_bytes(encoded(smooth_image(10 * c + i), quality=92))
    extra = root / "class0"
    (extra / "png.png").write_bytes(encoded(smooth_image(100), fmt="PNG"))
    (extra / "big.jpg").write_bytes(encoded(smooth_image(101, size=(80, 64)), quality=92))
    (extra / "corrupt.jpg").write_bytes(encoded(smooth_image(102))[:200])
    (extra / "fake.jpg").write_bytes(b"not an image at all")
    (extra / "tiny.jpg").write_bytes(encoded(smooth_image(103, size=(4, 4))))
    (extra / "notes.txt").write_text("ignored")
    (root / "class1" / "dup.jpg").write_bytes((root / "class0" / "img0.jpg").read_bytes())  # exact duplicate
    (root / "class2" / "near.jpg").write_bytes(encoded(smooth_image(11), quality=60))  # near duplicate of class1/img1
    return root


def read_members(shard):
    """(name, mtime, uid, uname, has a PAX header) per member."""
    with tarfile.open(shard) as tar:
        return [(m.name, m.mtime, m.uid, m.uname, bool(m.pax_headers)) for m in tar.getmembers()]


def test_write_folder_source_counts_dedup_and_format(folder_source, tmp_path):
    config = writer.WriteConfig(name="toy", samples_per_shard=5, max_short_side=32, processes=1, seed=1)
    report = writer.write_dataset(tmp_path / "out", config, source=open_source(folder_source))
    assert report.scanned == 18 + 7
    assert report.skipped == {"corrupt": 1, "not_image": 2, "too_small": 1}
    assert report.exact_duplicates == 1 and report.near_duplicates == 1
    assert report.written == 18 + 2 + 1  # 18 good + png + big + the near duplicate (flagged, kept)
    info = read_dataset_info(tmp_path / "out")
    assert info.num_samples == report.written and info.num_classes == 3 and len(info.shards) == 5
    assert info.class_names == ("class0", "class1", "class2")
    samples = pq.read_table(tmp_path / "out" / "samples.parquet").to_pylist()
    assert sum(r["near_duplicate"] for r in samples) == 1
    by_source = {r["source"]: r for r in samples}
    original = (folder_source / "class0" / "img3.jpg").read_bytes()
    assert by_source["class0/img3.jpg"]["sha256"] == sha256_hex(original)  # small JPEG: original bytes kept
    assert min(by_source["class0/big.jpg"]["width"], by_source["class0/big.jpg"]["height"]) == 32
    members = [n for s in info.shards for n, *_ in read_members(s.url)]
    assert {n.split(".", 1)[1] for n in members} == {"jpg", "cls", "json"}
    assert all(n.count(".") == 1 for n in members)  # keys have no dots
    with tarfile.open(info.shards[0].url) as tar:
        png_like = [json.loads(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".json")]
    assert all({"label", "label_name", "source", "width", "height", "sha256"} <= set(m) for m in png_like)
    labels = [r["label"] for r in samples]
    assert labels != sorted(labels)  # globally shuffled, not class-sorted
    assert validate(str(tmp_path / "out"), full=True).ok
    decoded = [
        k for _, _, keys in EvalStream(tmp_path / "out", batch_size=7, image_size=16, return_keys=True) for k in keys
    ]
    assert sorted(decoded) == sorted(r["key"] for r in samples)


@pytest.mark.timeout(120)
def test_rerun_after_interruption_is_byte_identical(folder_source, tmp_path, monkeypatch):
    config = writer.WriteConfig(samples_per_shard=4, max_short_side=32, seed=3, processes=2)
    writer.write_dataset(tmp_path / "clean", config, source=open_source(folder_source))

    original = writer._write_shard
    calls = []

    def crash_on_third(job):
        calls.append(job[1])
        if len(calls) == 3:
            (tmp_path / "resumed" / "shard-000002.tar.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt("simulated kill")
        return original(job)

    single = writer.WriteConfig(samples_per_shard=4, max_short_side=32, seed=3, processes=1)
    monkeypatch.setattr(writer, "_write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        writer.write_dataset(tmp_path / "resumed", single, source=open_source(folder_source))
    assert not (tmp_path / "resumed" / "manifest.parquet").exists()
    assert (tmp_path / "resumed" / "shard-000001.tar").exists()
    monkeypatch.setattr(writer, "_write_shard", original)
    writer.write_dataset(tmp_path / "resumed", single, source=open_source(folder_source))

    clean = sorted(p.name for p in (tmp_path / "clean").iterdir())
    resumed = sorted(p.name for p in (tmp_path / "resumed").iterdir())
    assert clean == resumed and not any(n.endswith(".tmp") for n in resumed)
    for name in clean:
        assert (tmp_path / "clean" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    # Plain ustar, one 512-byte header a member: no PAX header (a float mtime added one to each).
    members = read_members(tmp_path / "clean" / "shard-000000.tar")
    assert {m[1:] for m in members} == {(0, 0, "vitscale", False)}


def test_exclude_like_drops_images_of_an_eval_set(folder_source, tmp_path):
    eval_dir = tmp_path / "eval_images"
    eval_dir.mkdir()
    (eval_dir / "a.jpg").write_bytes((folder_source / "class1" / "img4.jpg").read_bytes())  # exact copy
    (eval_dir / "b.jpg").write_bytes(encoded(smooth_image(22), quality=50))  # re-encoded copy of class2/img2
    exclude = load_exclusion(eval_dir)
    config = writer.WriteConfig(samples_per_shard=50, max_short_side=32, processes=1)
    report = writer.write_dataset(tmp_path / "out", config, source=open_source(folder_source), exclude=exclude)
    assert report.excluded == 2
    sources = set(pq.read_table(tmp_path / "out" / "samples.parquet").column("source").to_pylist())
    assert "class1/img4.jpg" not in sources and "class2/img2.jpg" not in sources and "class2/img3.jpg" in sources
    # an eval shard folder works as the exclusion source too
    report2 = writer.write_dataset(
        tmp_path / "out2", config, source=open_source(folder_source), exclude=load_exclusion(tmp_path / "out")
    )
    # everything written before is excluded (its duplicate too); only the two images excluded before remain
    assert report2.excluded == report.written + report.exact_duplicates and report2.written == 2


def test_imagenet21k_tars_and_parquet_sources_through_the_cli(tmp_path, capsys):
    i21k = class_tars(tmp_path / "i21k", ["n01440764", "n01443537"], per_class=5)
    words = tmp_path / "words.txt"
    words.write_text("n01440764\ttench, Tinca tinca\nn01443537\tgoldfish\n")
    out = tmp_path / "i21k_shards"
    rc = write_cli.main(
        [
            "--source",
            str(i21k),
            "--out",
            str(out),
            "--class-names",
            str(words),
            "--samples-per-shard",
            "3",
            "--processes",
            "1",
        ]
    )
    assert rc == 0 and "wrote 10 in 4 shards" in capsys.readouterr().out
    info = read_dataset_info(out)
    assert info.class_names == ("tench, Tinca tinca", "goldfish") and info.num_samples == 10
    assert list(tmp_path.glob("*.JPEG")) == []  # read as streams, nothing extracted

    table = pa.table(
        {"img": [{"bytes": encoded(smooth_image(200 + i)), "path": None} for i in range(6)], "y": [0, 1, 2, 0, 1, 2]}
    )
    pq.write_table(table, tmp_path / "hf.parquet")
    rc = write_cli.main(
        [
            "--source",
            str(tmp_path / "hf.parquet"),
            "--out",
            str(tmp_path / "pq_shards"),
            "--image-column",
            "img",
            "--label-column",
            "y",
            "--processes",
            "1",
        ]
    )
    assert rc == 0
    assert read_dataset_info(tmp_path / "pq_shards").num_classes == 3


def test_write_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="samples-per-shard"):
        writer.WriteConfig(samples_per_shard=0).validate()
    with pytest.raises(ValueError, match="--seed 0 then, 9 now"):
        items = [(encoded(smooth_image(i)), 0, f"m{i}") for i in range(3)]
        writer.write_dataset(tmp_path / "x", writer.WriteConfig(processes=1), items=items, class_names=["a"])
        writer.write_dataset(tmp_path / "x", writer.WriteConfig(processes=1, seed=9), items=items, class_names=["a"])


KILL_AFTER_SHARDS = """
import os, signal, sys
from data_pipeline.write import writer as write
from data_pipeline.write.__main__ import main
original, done = write._write_shard, []
def write_then_die(job):
    result = original(job)
    done.append(job[1])
    if len(done) == int(sys.argv[1]):
        tmp = os.path.join(job[0], "shard-%06d.tar.tmp" % (job[1] + 1))
        open(tmp, "wb").write(b"half a shard")  # what a kill in the middle of the next shard leaves
        os.kill(os.getpid(), signal.SIGKILL)  # no exception handler, no cleanup: like kill -9 or a lost node
    return result
write._write_shard = write_then_die
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.timeout(180)
def test_killed_writer_process_resumes_without_rewriting_complete_shards(folder_source, tmp_path):
    """A writer process killed with SIGKILL after 2 shards, re-run with the same arguments: the complete shards
    are kept as they are (not rewritten) and the folder equals an uninterrupted run's, byte for byte."""
    args = ["--source", str(folder_source), "--samples-per-shard", "4", "--max-short-side", "32", "--processes", "1"]
    assert write_cli.main([*args, "--out", str(tmp_path / "clean")]) == 0
    out = tmp_path / "killed"
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_SHARDS, "2", *args, "--out", str(out)], check=False)
    assert killed.returncode == -signal.SIGKILL
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")}
    assert sorted(kept) == ["shard-000000.tar", "shard-000001.tar"] and not (out / "dataset.json").exists()
    assert write_cli.main([*args, "--out", str(out)]) == 0
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # complete shards were not written again
    clean = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert clean == sorted(p.name for p in out.iterdir()) and not any(n.endswith(".tmp") for n in clean)
    for name in clean:
        assert (tmp_path / "clean" / name).read_bytes() == (out / name).read_bytes(), name


def test_samples_table_is_streamed_in_row_groups(tmp_path):
    """samples.parquet is written a row group at a time and read back a batch at a time (bounded memory)."""
    rows = [
        dict(
            key=f"{i:09d}",
            shard="shard-000000.tar",
            label=i % 3,
            width=8,
            height=8,
            sha256="0" * 64,
            source_sha256="1" * 64,
            phash=-i,
            source=f"s{i}",
            near_duplicate=False,
            exact_duplicate=i == 5,
        )
        for i in range(1000)
    ]
    with manifest.SamplesWriter(tmp_path / "samples.parquet", row_group=300) as writer:
        for first in range(0, len(rows), 70):
            writer.write_rows(rows[first : first + 70])
        assert not (tmp_path / "samples.parquet").exists()  # only renamed into place when complete
    assert pq.ParquetFile(tmp_path / "samples.parquet").metadata.num_row_groups == 4  # 300 + 300 + 300 + 100 rows
    batches = list(manifest.iter_samples(tmp_path, columns=["key", "phash"], batch_rows=128))
    assert max(b.num_rows for b in batches) <= 128 and batches[0].schema.names == ["key", "phash"]
    assert [r for b in batches for r in b.to_pylist()] == [dict(key=r["key"], phash=r["phash"]) for r in rows]
    with pytest.raises(manifest.ShardFormatError, match="no column"):
        next(manifest.iter_samples(tmp_path, columns=["nope"]))
    with pytest.raises(manifest.ShardFormatError, match="missing"):
        next(manifest.iter_samples(tmp_path / "elsewhere"))
    with pytest.raises(RuntimeError), manifest.SamplesWriter(tmp_path / "b.parquet") as writer:
        writer.write_rows(rows[:3])
        raise RuntimeError("interrupted")
    assert list(tmp_path.glob("b.parquet*")) == []  # an interrupted table leaves nothing behind


def _mutate(source, tmp_path, change: str) -> list[str]:
    """Change the source folder as ``change`` says; the extra CLI arguments it needs."""
    if change == "added":
        (source / "class1" / "new.jpg").write_bytes(encoded(smooth_image(301), quality=92))
    elif change == "removed":
        (source / "class1" / "img2.jpg").unlink()
    elif change == "moved":
        (source / "class0" / "img3.jpg").rename(source / "class1" / "moved.jpg")
    elif change == "replaced":
        (source / "class2" / "img0.jpg").write_bytes(encoded(smooth_image(302), quality=92))
    elif change == "excluded":
        (tmp_path / "eval").mkdir()
        (tmp_path / "eval" / "e.jpg").write_bytes((source / "class2" / "img4.jpg").read_bytes())
        return ["--exclude-like", str(tmp_path / "eval")]
    return []


@pytest.mark.parametrize("change", ["added", "removed", "moved", "replaced", "excluded"])
def test_rerun_into_a_folder_of_other_input_is_refused(folder_source, tmp_path, capsys, change):
    """The finished shards a re-run keeps must hold this run's images: other input is refused, nothing is lost."""
    out = tmp_path / "out"
    args = ["--source", str(folder_source), "--out", str(out), "--samples-per-shard", "4", "--processes", "1"]
    assert write_cli.main(args) == 0
    settings_file = out / manifest.WRITE_SETTINGS_FILE
    settings = json.loads(settings_file.read_text())
    settings.pop("input", None)  # as older versions wrote it: accepted
    settings_file.write_text(json.dumps(settings))
    shards = {p.name: p.read_bytes() for p in out.glob("shard-*.tar")}
    assert write_cli.main(args) == 0  # an unchanged re-run keeps every shard (and records the input)
    assert {n: (out / n).read_bytes() for n in shards} == shards
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert write_cli.main([*args, *_mutate(folder_source, tmp_path, change)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(
        f"{out} holds shards of other input (images added, removed, changed or "
        "excluded since); choose a new --out or delete it"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written, nothing lost


def test_failed_run_leaves_nothing_that_refuses_the_corrected_one(tmp_path, capsys):
    """Every option is checked before --out is written; a run that fails later leaves no settings that refuse the
    next run, since settings are compared only where shards exist."""
    src = tmp_path / "src"
    for c in range(2):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(3):
            (src / f"c{c}" / f"{i}.jpg").write_bytes(encoded(smooth_image(10 * c + i)))
    out = tmp_path / "out"
    base = ["--source", str(src), "--out", str(out), "--processes", "1"]
    for bad, message in [
        (["--near-duplicate-distance", "-1"], "--near-duplicate-distance must be in [0, 15], got -1"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--min-size", "0", "--max-short-side", "0"], "--min-size must be >= 1, got 0"),
    ]:
        assert write_cli.main([*base, *bad]) == 2
        assert capsys.readouterr().err.strip().endswith(message)
        assert not out.exists()
    assert write_cli.main([*base, "--seed", "4"]) == 0
    items = [(b"not an image", 0, "bad")]
    with pytest.raises(ValueError, match="no valid images"):
        writer.write_dataset(tmp_path / "x", writer.WriteConfig(processes=1, seed=5), items=items, class_names=["a"])
    items = [(encoded(smooth_image(i)), 0, f"m{i}") for i in range(3)]
    report = writer.write_dataset(tmp_path / "x", writer.WriteConfig(processes=1), items=items, class_names=["a"])
    assert report.written == 3


def test_out_inside_the_source_is_refused(folder_source, capsys):
    for out in (folder_source / "shards", folder_source):
        assert write_cli.main(["--source", str(folder_source), "--out", str(out), "--processes", "1"]) == 2
        assert f"--out {out} is the --source folder {folder_source} or inside it" in capsys.readouterr().err
    assert not (folder_source / "shards").exists() and not list(folder_source.glob("shard-*"))


def test_exclude_like_skips_folders_named_like_images(folder_source, tmp_path):
    eval_dir = tmp_path / "eval_images"
    (eval_dir / "weird.jpg").mkdir(parents=True)
    (eval_dir / "weird.jpg" / "inner.jpg").write_bytes((folder_source / "class1" / "img4.jpg").read_bytes())
    exclude = load_exclusion(eval_dir)
    assert exclude.sha256s == {sha256_hex((folder_source / "class1" / "img4.jpg").read_bytes())}


def _stored_grey(tmp_path, capsys, images: int) -> list[np.ndarray]:
    """Write ``tmp_path/src`` to ``tmp_path/out``: each stored image's grey pixels."""
    assert write_cli.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--processes", "1"]) == 0
    assert f"wrote {images} in 1 shards" in capsys.readouterr().out
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        stored = [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")]
    return [np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.float64) for data in stored]


def test_16_bit_grey_images_keep_their_tones_instead_of_turning_white(tmp_path, capsys):
    """A 16-bit grey PNG or TIFF (microscopy, medical, satellite) used to be clipped at 255: a white image."""
    ramp = np.linspace(0, 65535, 48 * 64).reshape(48, 64).astype(np.uint16)
    grey8 = Image.fromarray(((ramp.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8))
    (tmp_path / "src" / "scans").mkdir(parents=True)
    Image.fromarray(ramp).save(tmp_path / "src" / "scans" / "a.png")
    Image.frombytes("I;16B", (64, 48), ramp.astype(">u2").tobytes()).save(tmp_path / "src" / "scans" / "b.tif")
    for pixels in _stored_grey(tmp_path, capsys, images=2):
        assert abs(pixels.mean() - np.asarray(grey8).mean()) < 2 and pixels.std() > 60  # a ramp, not all white
    phashes = pq.read_table(tmp_path / "out" / "samples.parquet").column("phash").to_pylist()
    assert phashes == [writer.perceptual_hash(grey8)] * 2  # near-duplicate search sees the ramp too


def test_float_grey_tiffs_keep_their_tones_instead_of_turning_black(tmp_path, capsys):
    """A 32-bit float TIFF (mode F) on the 0-1 scale used to be rounded to 0 or 1 by Pillow's convert: a black image.
    On the 0-255 scale it is read as it is."""
    ramp = np.linspace(0, 1, 48 * 64).reshape(48, 64).astype(np.float32)
    (tmp_path / "src" / "scans").mkdir(parents=True)
    Image.fromarray(ramp, mode="F").save(tmp_path / "src" / "scans" / "unit.tif")
    Image.fromarray(ramp * 255, mode="F").save(tmp_path / "src" / "scans" / "byte.tif")
    for pixels in _stored_grey(tmp_path, capsys, images=2):
        assert abs(pixels.mean() - 127.5) < 2 and pixels.std() > 60  # a ramp, not all black


def test_a_photo_taken_sideways_is_stored_upright(tmp_path, capsys):
    """A phone's portrait photo is a landscape sensor image with EXIF orientation 6: Pillow decodes it on its side and
    a re-encode dropped the tag, so it used to be stored (and trained on) sideways."""
    sensor = np.zeros((48, 64, 3), np.uint8)
    sensor[:, :32] = (255, 0, 0)  # the sensor's left half red: on top once turned 90 degrees clockwise
    (tmp_path / "src" / "photos").mkdir(parents=True)
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    Image.fromarray(sensor).save(tmp_path / "src" / "photos" / "portrait.jpg", exif=exif, quality=95)
    Image.fromarray(sensor).save(tmp_path / "src" / "photos" / "landscape.jpg", quality=95)
    assert write_cli.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--processes", "1"]) == 0
    capsys.readouterr()
    samples = pq.read_table(tmp_path / "out" / "samples.parquet").to_pylist()
    by_source = {Path(row["source"]).name: row for row in samples}
    assert (by_source["portrait.jpg"]["width"], by_source["portrait.jpg"]["height"]) == (48, 64)
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        stored = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")}
    portrait = np.asarray(Image.open(io.BytesIO(stored[by_source["portrait.jpg"]["key"] + ".jpg"])).convert("RGB"))
    assert portrait.shape == (64, 48, 3) and portrait[:32, :, 0].mean() > 200 and portrait[32:, :, 0].mean() < 50
    landscape = (tmp_path / "src" / "photos" / "landscape.jpg").read_bytes()
    assert stored[by_source["landscape.jpg"]["key"] + ".jpg"] == landscape  # no orientation: stored as it is


def test_a_class_folder_without_images_is_kept_and_named_in_the_summary(folder_source, tmp_path, capsys):
    """Its label stays (the folder order gives the labels, the same in every split), and the summary names it."""
    (folder_source / "class3_empty").mkdir()
    (folder_source / "class3_empty" / "notes.txt").write_text("to do")
    argv = ["--source", str(folder_source), "--out", str(tmp_path / "out"), "--processes", "1"]
    assert write_cli.main([*argv, "--max-short-side", "32"]) == 0
    assert "; no image in 1 of the classes (kept, so labels stay): class3_empty\n" in capsys.readouterr().out
    assert read_dataset_info(tmp_path / "out").class_names == ("class0", "class1", "class2", "class3_empty")


def test_hidden_folders_and_files_are_neither_classes_nor_images(folder_source, tmp_path, capsys):
    """Jupyter's .ipynb_checkpoints and macOS's .DS_Store and ._ copies: a hidden folder used to become class 0,
    shifting every label; hidden files are now skipped and counted as `hidden`."""
    (folder_source / ".ipynb_checkpoints").mkdir()
    (folder_source / ".ipynb_checkpoints" / "x.jpg").write_bytes(encoded(smooth_image(200)))
    (folder_source / "class1" / ".ipynb_checkpoints").mkdir()
    (folder_source / "class1" / ".ipynb_checkpoints" / "img1-checkpoint.jpg").write_bytes(encoded(smooth_image(201)))
    (folder_source / "class0" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder_source / "class0" / "._img0.jpg").write_bytes(b"\0\5\26\7AppleDouble")
    argv = ["--source", str(folder_source), "--out", str(tmp_path / "out"), "--processes", "1"]
    assert write_cli.main([*argv, "--max-short-side", "32"]) == 0
    summary = capsys.readouterr().out
    assert "skipped {'corrupt': 1, 'hidden': 3, 'not_image': 2, 'too_small': 1}" in summary
    assert "no image in" not in summary
    info = read_dataset_info(tmp_path / "out")
    assert info.class_names == ("class0", "class1", "class2") and info.num_samples == 21
    sources = pq.read_table(tmp_path / "out" / "samples.parquet").column("source").to_pylist()
    assert not [s for s in sources if "/." in s or s.startswith(".")]


def test_a_parquet_source_of_many_files_is_read_once_per_file_and_shard_not_once_per_image(tmp_path, monkeypatch):
    """The pre-shuffle scatters every file's rows over every shard: reading a whole file's image column per image
    (two files cached) would read a collection of F files about N times over instead of at most S x F times."""
    src = tmp_path / "hf"
    src.mkdir()
    for f in range(6):
        images = [{"bytes": encoded(smooth_image(300 + 20 * f + i)), "path": None} for i in range(20)]
        # several row groups a file: only those holding a shard's rows are read
        pq.write_table(pa.table({"image": images, "label": [i % 3 for i in range(20)]}), src / f"{f}.parquet", 7)
    reads = []
    read_table, read_row_groups = pq.read_table, pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq, "read_table", lambda *a, **kw: reads.append(a[0]) or read_table(*a, **kw))
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_groups", lambda self, *a, **kw: reads.append(self) or read_row_groups(self, *a, **kw)
    )
    report = writer.write_dataset(
        tmp_path / "out", writer.WriteConfig(samples_per_shard=40, processes=1), source=open_source(src)
    )
    assert report.written == 120 and report.shards == 3
    assert len(reads) <= 2 * 6 + 3 * 6  # the scan's two reads of each file, then one per file and shard
    stored = {s["sha256"] for s in pq.read_table(tmp_path / "out" / "samples.parquet").to_pylist()}
    assert stored == {sha256_hex(encoded(smooth_image(300 + 20 * f + i))) for f in range(6) for i in range(20)}
    assert validate(str(tmp_path / "out"), full=True).ok


def test_names_that_are_not_utf8_are_written_readably_instead_of_failing_after_the_scan(tmp_path, capsys):
    """Linux names are bytes: a folder or file named in Latin-1 decodes to surrogates, which samples.parquet and
    classes.parquet cannot hold, so the write failed after the whole scan with a line naming no file."""
    src = os.fsencode(tmp_path / "src")
    os.makedirs(src + b"/caf\xe9")
    os.makedirs(src + b"/plain")
    with open(src + b"/caf\xe9/cr\xe8me.jpg", "wb") as f:
        f.write(encoded(smooth_image(1)))
    (tmp_path / "src" / "plain" / "a.jpg").write_bytes(encoded(smooth_image(2)))
    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "n01.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        data = encoded(smooth_image(3))
        info = tarfile.TarInfo("na\udcefve.JPEG")  # tarfile's reading of the byte 0xef
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    for source, want in ((tmp_path / "src", {"caf\\xe9/cr\\xe8me.jpg", "plain/a.jpg"}), (tars, {"n01:na\\xefve.JPEG"})):
        out = tmp_path / f"out_{source.name}"
        argv = ["--source", str(source), "--out", str(out), "--processes", "1"]
        assert write_cli.main(argv) == 0, capsys.readouterr()
        assert set(pq.read_table(out / "samples.parquet").column("source").to_pylist()) == want
        assert validate(str(out), full=True).ok
    assert read_dataset_info(tmp_path / "out_src").class_names == ("caf\\xe9", "plain")


def test_broken_links_are_counted_not_silently_dropped(tmp_path, capsys):
    """A class of symlinks into a store this node has not mounted: its images vanished from the summary's counts, as
    did a linked folder's inside a class."""
    (tmp_path / "src" / "here").mkdir(parents=True)
    (tmp_path / "src" / "here" / "a.jpg").write_bytes(encoded(smooth_image(1)))
    (tmp_path / "src" / "mounted").mkdir()
    (tmp_path / "src" / "mounted" / "b.jpg").symlink_to(tmp_path / "src" / "here" / "a.jpg")  # a link that works
    (tmp_path / "src" / "unmounted").mkdir()
    for name in ("c.jpg", "d.jpg"):
        (tmp_path / "src" / "unmounted" / name).symlink_to(tmp_path / "gone" / name)
    (tmp_path / "src" / "here" / "more").symlink_to(tmp_path / "src" / "mounted")  # not followed: counted
    argv = ["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--processes", "1"]
    assert write_cli.main([*argv, "--keep-exact-duplicates"]) == 0
    summary = capsys.readouterr().out
    assert "scanned 2 images, wrote 2" in summary and "skipped {'broken_links': 2, 'linked_folders': 1}" in summary


@pytest.mark.parametrize(
    ("lines", "names"),
    [
        ("0 cat\n1 cow\n2 dog\n", ("cat", "cow", "dog")),  # 'id name' lines, as --class-names says
        ("2\tdog\n0\tcat\n5\tbird\n", ("cat", "1", "dog", "3", "4", "bird")),  # a label map with gaps
        ("cat\ncow\ndog\n", ("cat", "cow", "dog")),
    ],
)
def test_parquet_class_names_by_label_id(tmp_path, lines, names):
    """A Parquet source's ids are its labels: 'id name' lines used to become the names "0 cat", ..., and an
    'id<TAB>name' map with gaps was refused as too short."""
    labels = [0, 2, 0, 2] if "5" not in lines else [0, 2, 5, 5]
    images = [encoded(smooth_image(i)) for i in range(4)]
    pq.write_table(pa.table({"image": images, "label": labels}), tmp_path / "d.parquet")
    (tmp_path / "names.txt").write_text(lines)
    assert open_source(tmp_path / "d.parquet", class_names_file=tmp_path / "names.txt").class_names == names


def test_parquet_class_names_keyed_by_other_ids_are_refused(tmp_path):
    """wnid<TAB>name lines name no Parquet label: the names used to be replaced by "0", "1", ... without a word."""
    pq.write_table(pa.table({"image": [encoded(smooth_image(0))], "label": [1]}), tmp_path / "d.parquet")
    (tmp_path / "names.txt").write_text("n01440764\ttench\nn01443537\tgoldfish\n")
    with pytest.raises(ValueError, match="names.txt.*label"):
        open_source(tmp_path / "d.parquet", class_names_file=tmp_path / "names.txt")


def test_the_summary_says_kept_duplicates_were_kept(folder_source, tmp_path, capsys):
    """With --keep-exact-duplicates (always for a TFDS split) they are written; the summary said "(dropped)"."""
    argv = ["--source", str(folder_source), "--out", str(tmp_path / "out"), "--processes", "1"]
    assert write_cli.main([*argv, "--max-short-side", "32", "--keep-exact-duplicates"]) == 0
    summary = capsys.readouterr().out
    assert "wrote 22 in" in summary and "exact duplicates 1 (kept, flagged)" in summary
    assert write_cli.main([*argv[:3], str(tmp_path / "out2"), *argv[4:], "--max-short-side", "32"]) == 0
    summary = capsys.readouterr().out
    assert "wrote 21 in" in summary and "exact duplicates 1 (dropped)" in summary


@pytest.mark.parametrize("kind", ["folder", "tars"])
def test_source_files_removed_or_changed_after_the_scan_are_skipped_and_counted(
    folder_source, tmp_path, monkeypatch, capsys, kind
):
    """A source file removed between the scan and the write pass ended the write in a FileNotFoundError traceback;
    one rewritten was stored, under the source_sha256 (and the dedup and --exclude-like checks) of the bytes the scan
    read. Both are now skipped and counted, and the manifest and samples.parquet hold what the shards hold."""
    if kind == "tars":
        source = class_tars(tmp_path / "tars", ["n00", "n01", "n02"], per_class=5)
        gone, changed = source / "n01.tar", source / "n02.tar"
        lost = 10
    else:
        source = folder_source
        gone, changed = source / "class0" / "img1.jpg", source / "class1" / "img2.jpg"
        lost = 2
    real = writer.dedup_candidates

    def then_change_the_source(*args):
        survivors = real(*args)
        gone.unlink()
        if kind == "tars":  # the same members at the same offsets, other images
            changed.write_bytes((class_tars(tmp_path / "other", ["x", "y", "z", "n02"], 5) / "n02.tar").read_bytes())
        else:
            changed.write_bytes(encoded(smooth_image(999), quality=92))
        return survivors

    monkeypatch.setattr(writer, "dedup_candidates", then_change_the_source)
    out = tmp_path / "out"
    assert write_cli.main(["--source", str(source), "--out", str(out), "--samples-per-shard", "4"]) == 0
    assert "'removed_or_changed_since_scan': " + str(lost) in capsys.readouterr().out
    samples = pq.read_table(out / "samples.parquet").to_pylist()
    info = read_dataset_info(out)
    assert info.num_samples == len(samples) == (21 if kind == "folder" else 15) - lost
    assert not {r["source"] for r in samples} & {"class0/img1.jpg", "class1/img2.jpg"}
    for shard in info.shards:
        with tarfile.open(shard.url) as tar:
            stored = {m.name.split(".")[0]: tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")}
        rows = [r for r in samples if r["shard"] == Path(shard.url).name]
        assert shard.samples == len(rows) == len(stored)
        assert all(sha256_hex(stored[r["key"]]) == r["sha256"] for r in rows)
    assert all(r["sha256"] == r["source_sha256"] for r in samples if r["source"] != "class0/png.png")
    assert validate(str(out), full=True).ok


def test_a_source_removed_whole_after_the_scan_is_one_error_line(tmp_path, monkeypatch, capsys):
    source = tmp_path / "src" / "only"
    source.mkdir(parents=True)
    (source / "a.jpg").write_bytes(encoded(smooth_image(1)))
    real = writer.dedup_candidates

    def then_remove_it(*args):
        survivors = real(*args)
        (source / "a.jpg").unlink()
        return survivors

    monkeypatch.setattr(writer, "dedup_candidates", then_remove_it)
    assert write_cli.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "every source file was removed or changed since the scan" in err
    assert not (tmp_path / "out" / manifest.MANIFEST_FILE).exists()


@pytest.mark.parametrize(
    ("images", "kind"),
    [(["a.jpg", "b.jpg"], "string"), ([{"path": "a.jpg"}, {"path": "b.jpg"}], "struct<path: string>")],
)
def test_a_parquet_image_column_without_image_bytes_is_one_error_line(tmp_path, capsys, images, kind):
    """Paths, or HF structs without their bytes, ended the scan in a TypeError or KeyError traceback."""
    pq.write_table(pa.table({"image": images, "label": [0, 1], "jpg": [b"x", b"y"]}), tmp_path / "d.parquet")
    argv = ["--source", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "out"), "--processes", "1"]
    assert write_cli.main(argv) == 2
    err = capsys.readouterr().err
    said = f"error: {tmp_path / 'd.parquet'}: image column 'image' holds {kind} values, not encoded image bytes"
    assert said in err and "--image-column (such columns here: ['jpg'])" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def class_folders(root: Path, names: list[str]) -> Path:
    """``root`` with one image in each class sub-folder."""
    for c, name in enumerate(names):
        (root / name).mkdir(parents=True)
        (root / name / "a.jpg").write_bytes(encoded(smooth_image(300 + c)))
    return root


@pytest.mark.parametrize("lines", ["0\tKatze\n1\tHund\n2\tAal\n", "0 Katze\n1 Hund\n2 Aal\n", "n01\ttench\n"])
def test_class_names_keyed_by_ids_no_class_has_are_refused(tmp_path, lines):
    """'id<TAB>name' lines naming no folder were ignored (the folder names kept), and 'id name' lines keyed by label
    became the names "0 Katze", ... without a word."""
    source = class_folders(tmp_path / "src", ["cat", "dog", "eel"])
    (tmp_path / "names.txt").write_text(lines)
    match = r"names.txt: ids such as '(0|n01)' match no class of the source \(its ids: cat, dog, eel\); key each"
    with pytest.raises(ValueError, match=match):
        open_source(source, class_names_file=tmp_path / "names.txt")
    (tmp_path / "names.txt").write_text("eel\tAal\ncat\tKatze\nzebra\tZebra\n")  # a map of more classes: still read
    assert open_source(source, class_names_file=tmp_path / "names.txt").class_names == ("Katze", "dog", "Aal")


@pytest.mark.parametrize("kind", ["folder", "tars"])
def test_a_plain_class_name_list_of_another_length_is_refused(tmp_path, kind):
    """A list longer than the classes was taken, its first names given to the classes in order."""
    if kind == "tars":
        source = class_tars(tmp_path / "src", ["n01", "n02", "n03"], per_class=1)
    else:
        source = class_folders(tmp_path / "src", ["cat", "dog", "eel"])
    for names in ("tench\ngoldfish\nshark\nray\n", "tench\ngoldfish\n"):
        (tmp_path / "names.txt").write_text(names)
        count = names.count("\n")
        with pytest.raises(ValueError, match=f"names.txt has {count} names but the source has 3 classes; give one"):
            open_source(source, class_names_file=tmp_path / "names.txt")
    (tmp_path / "names.txt").write_text("tench\ngoldfish\nshark\n")
    assert open_source(source, class_names_file=tmp_path / "names.txt").class_names == ("tench", "goldfish", "shark")


@pytest.mark.parametrize("stray", ["backup.tar", "meta.parquet"])
def test_class_folders_beside_a_tar_or_parquet_file_ask_for_kind(tmp_path, capsys, stray):
    """A stray .tar or .parquet beside the class folders was read as the whole source, the folders' images dropped."""
    source = class_folders(tmp_path / "src", ["cat", "dog"])
    if stray.endswith(".tar"):
        (source / stray).write_bytes((class_tars(tmp_path / "tars", ["backup"], per_class=1) / stray).read_bytes())
    else:
        pq.write_table(pa.table({"image": [encoded(smooth_image(0))], "label": [0]}), source / stray)
    argv = ["--source", str(source), "--out", str(tmp_path / "out"), "--processes", "1"]
    assert write_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--source {source} holds both class sub-folders (cat, dog) and {Path(stray).suffix} files ({stray})" in err
    assert "--kind folder, --kind imagenet21k (per-class .tar files) or --kind parquet" in err and err.count("\n") == 1
    assert write_cli.main([*argv, "--kind", "folder"]) == 0
    assert "wrote 2 in" in capsys.readouterr().out
