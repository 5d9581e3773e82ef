"""Built-in datasets: offline, deterministic, the promised splits and sizes, readable by the streams."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import numpy as np
import pytest

from data_pipeline.builtin import __main__ as builtin_cli
from data_pipeline.builtin import sets as builtin
from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.validate import validate

SMALL = dict(num_classes=4, images_per_class=12, val_per_class=3, resolution=32, samples_per_shard=16)


@pytest.mark.timeout(60)
def test_fractal_is_deterministic_by_seed_and_sized_by_config(tmp_path):
    a = builtin.ensure("fractal", tmp_path / "a", **SMALL)
    b = builtin.ensure("fractal", tmp_path / "b", **SMALL)
    c = builtin.ensure("fractal", tmp_path / "c", **{**SMALL, "seed": 1})
    assert a == tmp_path / "a" / "fractal"
    info = read_dataset_info(a / "train")
    assert (info.num_classes, info.num_samples) == (4, 48) and read_dataset_info(a / "val").num_samples == 12
    for shard in ("shard-000000.tar", "shard-000002.tar"):
        assert (a / "train" / shard).read_bytes() == (b / "train" / shard).read_bytes()
    assert (a / "train" / "shard-000000.tar").read_bytes() != (c / "train" / "shard-000000.tar").read_bytes()
    x, y = next(iter(EvalStream(a / "train", batch_size=48, image_size=32)))
    assert x.shape == (48, 3, 32, 32) and sorted(set(y.tolist())) == [0, 1, 2, 3]
    # per-image variation: two images of one class differ, and classes differ on average
    per_class = [x[y == k].mean(0) for k in range(4)]
    assert not np.allclose(x[y == 0][0], x[y == 0][1])
    assert min(float((per_class[i] - per_class[j]).abs().mean()) for i in range(4) for j in range(i)) > 0.0
    assert validate(str(a / "train"), full=True).ok


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "name, classes", [("digits", 10), ("dsprites_loc", 16), ("dsprites_ori", 16), ("shapes_count", 8)]
)
def test_eval_datasets_have_vtab_sized_splits(tmp_path, name, classes):
    overrides = {} if name == "digits" else dict(num_train=1000, num_test=60)
    folder = builtin.ensure(name, tmp_path, resolution=32, samples_per_shard=256, **overrides)
    train, test = read_dataset_info(folder / "train"), read_dataset_info(folder / "test")
    assert train.num_samples >= 1000 and train.num_classes == classes == len(train.class_names)
    if name == "digits":
        assert (train.num_samples, test.num_samples) == (1297, 500)
    labels = [int(y) for _, ys in EvalStream(folder / "test", batch_size=128, image_size=32) for y in ys]
    assert len(labels) == test.num_samples and len(set(labels)) > classes // 2


def test_dsprites_loc_and_ori_share_images_with_different_labels(tmp_path):
    sizes = dict(num_train=40, num_test=20, resolution=32, samples_per_shard=64)
    loc = builtin.ensure("dsprites-loc", tmp_path, **sizes)
    ori = builtin.ensure("dsprites_ori", tmp_path, **sizes)
    xl, yl = next(iter(EvalStream(loc / "test", batch_size=20, image_size=32)))
    xo, yo = next(iter(EvalStream(ori / "test", batch_size=20, image_size=32)))
    # both folders are pre-shuffled with the same seed, so they hold the same images in the same order
    assert np.array_equal(xl.numpy(), xo.numpy()) and not np.array_equal(yl.numpy(), yo.numpy())


def test_a_digits_test_split_the_set_cannot_hold_is_refused(tmp_path, capsys):
    """scikit-learn's 1797 digits keep 1000 for train: num_test=1000 wrote 797 test images without a word."""
    with pytest.raises(ValueError, match=r"num_test=1000 is out of range for digits; use 1\.\.797"):
        builtin.ensure("digits", tmp_path, num_test=1000)
    assert builtin_cli.main(["digits", "--out", str(tmp_path), "--set", "num_test=900"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("python -m data_pipeline.builtin: error: num_test=900 is out of range") and err.count("\n") == 1
    )
    assert not (tmp_path / "digits").exists()


def test_ensure_reuses_and_refuses_mismatched_sizes(tmp_path):
    sizes = dict(num_train=20, num_test=10, resolution=16, samples_per_shard=8)
    folder = builtin.ensure("shapes_count", tmp_path, **sizes)
    stamp = (folder / "train" / "manifest.parquet").stat().st_mtime_ns
    assert builtin.ensure("shapes_count", tmp_path, **sizes) == folder
    assert (folder / "train" / "manifest.parquet").stat().st_mtime_ns == stamp  # not regenerated
    assert builtin.ensure("shapes_count", tmp_path, **sizes, num_classes=99) == folder  # a fractal-only field
    with pytest.raises(ValueError, match="generated with"):
        builtin.ensure("shapes_count", tmp_path, **{**sizes, "num_train": 30})
    with pytest.raises(ValueError, match="unknown built-in dataset"):
        builtin.ensure("imagenet", tmp_path)
    with pytest.raises(ValueError, match="unknown built-in size"):
        builtin.ensure("digits", tmp_path, colour=3)


def test_concurrent_ensure_generates_once(tmp_path):
    sizes = dict(num_train=30, num_test=10, resolution=16, samples_per_shard=8)
    results, errors = [], []

    def call():
        try:
            results.append(builtin.ensure("dsprites_loc", tmp_path, **sizes))
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    assert read_dataset_info(results[0] / "train").num_samples == 30


def test_cli_writes_the_documented_layout(tmp_path, capsys):
    rc = builtin_cli.main(["digits", "--out", str(tmp_path), "--set", "resolution=16"])
    assert rc == 0 and "digits" in capsys.readouterr().out
    meta = json.loads((tmp_path / "digits" / "train" / "dataset.json").read_text())
    assert {"name", "split", "num_classes", "num_samples"} <= set(meta) and meta["split"] == "train"
    assert builtin_cli.main(["nope", "--out", str(tmp_path)]) == 2
    spec = DataConfig.for_stream(
        tmp_path / "digits" / "train", micro_batch_size=8, image_size=16, num_workers=2, world_size=2
    )
    stream = TrainStream(spec, world_size=2, rank=1)
    x, y = next(iter(stream))
    assert x.shape == (8, 3, 16, 16) and y.dtype.is_floating_point is False


# ------------------------------------------------------------- each set's defaults: `make shards` then `make launch`


def test_rcdb_defaults_are_the_set_local_demo_trains_on():
    """The recipe names its sizes again (data.builtin_options); they must stay rcdb's defaults, or `make shards`
    writes a folder `make launch` refuses (issue #51)."""
    from pretrain.config.train_config import load_config

    recipe = load_config("local_demo")
    assert recipe.data.builtin == "rcdb"
    assert builtin.config("rcdb") == builtin.config("rcdb", **recipe.data.builtin_options)
    assert (builtin.config("rcdb").resolution, builtin.config("rcdb").num_classes) == (32, 64)
    # the other sets keep BuiltinConfig's defaults; --set / builtin_options still win over a set's own
    assert builtin.config("fractal") == builtin.BuiltinConfig() == builtin.config("digits")
    assert builtin.config("rcdb", resolution=48).resolution == 48
    with pytest.raises(ValueError, match="unknown built-in size option"):
        builtin.config("rcdb", colour=3)


def test_check_folder_generates_nothing_and_names_the_settings_and_the_fix(tmp_path, capsys):
    sizes = dict(num_train=20, num_test=10, resolution=16, samples_per_shard=8)
    assert builtin.check_folder("shapes_count", tmp_path, **sizes) is False
    assert not (tmp_path / "shapes_count").exists()  # nothing made, not even the folder
    folder = builtin.ensure("shapes_count", tmp_path, **sizes)
    assert builtin.check_folder("shapes-count", tmp_path, **sizes) is True
    (folder / "test" / "dataset.json").unlink()  # one split gone: incomplete, so ensure would generate it
    assert builtin.check_folder("shapes_count", tmp_path, **sizes) is False
    where = re.escape(str(folder))
    message = (
        rf"{where}/train was generated with resolution=16 \(wanted 64\), num_train=20 \(wanted 1200\), "
        rf"num_test=10 \(wanted 500\), samples_per_shard=8 \(wanted 128\); delete it \(rm -r {where}\)"
    )
    with pytest.raises(ValueError, match=message):  # at the set's defaults
        builtin.check_folder("shapes_count", tmp_path)
    # `all` checks every folder before it generates any: a stale one stops it with that line, nothing written
    assert builtin_cli.main(["all", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes_count"]


def test_make_shards_writes_what_every_shipped_recipe_and_suite_reads():
    """`make shards` is `python -m data_pipeline.builtin all --out data`, which writes each set at its defaults
    (`builtin.config(name)`); any shipped recipe with `data.builtin` (`make launch`) or eval suite naming built-in
    sets reads each of its folders under data/ at exactly those settings, so the folders `make shards` wrote are
    reused as written (issue #51). Folders are compared by their settings, as `check_folder` does: the tests above
    show it accepts a folder written at the same ones and refuses one written at others."""
    from cluster.local_data import builtin_requirements
    from data_pipeline.paths import PROJECT_ROOT, RECIPE_DIR, SUITES_DIR
    from evals.suites import load_suite
    from pretrain.config.train_config import load_config

    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert "$(PY) -m data_pipeline.builtin all --out data\n" in makefile  # the shards target
    needs = []
    for recipe in sorted(RECIPE_DIR.glob("*.yaml")):
        config = load_config(recipe.stem)
        suite = load_suite(config.evals.suite) if config.evals.suite else None
        needs += [(recipe.name, *need) for need in builtin_requirements(config, suite)]
    demo = load_config("local_demo")
    bare = dataclasses.replace(demo, data=dataclasses.replace(demo.data, builtin=None))  # the suite's needs alone
    for path in sorted(SUITES_DIR.glob("*.yaml")):
        needs += [(path.name, *need) for need in builtin_requirements(bare, load_suite(path))]
    read = {(where, name) for where, name, _, _ in needs}
    assert {("local_demo.yaml", "rcdb"), ("local_mpp.yaml", "digits"), ("inspect_rcdb.yaml", "rcdb")} <= read
    assert {"digits", "dsprites_loc", "dsprites_ori", "shapes_count"} <= {name for _, name in read}
    for where, name, root, options in needs:
        assert root == PROJECT_ROOT / "data", where  # where `make shards` writes them
        assert builtin.settings(name, **options) == builtin.settings(name), (where, name, options)


def test_eval_sets_under_a_bucket_are_neither_checked_nor_generated_here():
    """An `evals.data_root` of s3:// is read as it is by the eval tasks; before, the launch took it for a local
    path and generated the sets into a folder named `s3:` in the project."""
    from cluster.local_data import builtin_requirements, check_local_data
    from evals.suites import load_suite
    from pretrain.config.train_config import load_config

    config = load_config("local_demo", ["evals.data_root=s3://vitscale-evals/data"])
    suite = load_suite(config.evals.suite)
    assert [name for name, _, _ in builtin_requirements(config, suite)] == ["rcdb"]  # the training set only
    assert all("s3:" not in str(folder) for folder in check_local_data(config, suite))


def test_a_recipe_trained_on_the_users_own_shards_generates_no_built_in_set_beside_them(tmp_path):
    """`make launch SET="data.train=<my shards>"` on a recipe with data.builtin: the launch generated the built-in set
    at the shards' grandparent (`/tmp/rcdb` for /tmp/mine/train), and refused the launch where a folder there had other
    settings. The set is the training set only at its own folder, <root>/<builtin>/<split>."""
    from cluster.local_data import builtin_requirements, check_local_data
    from pretrain.config.train_config import load_config

    mine = builtin.ensure("digits", tmp_path / "shards") / "train"  # a shard folder of the user's, not rcdb's
    config = load_config("local_demo", [f"data.train={mine}", "data.streams=2"])
    assert config.data.builtin == "rcdb" and not config.data.generates_builtin
    assert builtin_requirements(config, None) == [] and check_local_data(config, None) == {}
    config.data.ensure_builtin()
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["digits"]  # no rcdb beside it
    assert load_config("local_demo", []).data.generates_builtin  # the recipe's own data/rcdb/train


def test_a_built_in_training_set_generated_at_other_settings_names_the_settings_to_train_on_it(tmp_path):
    """`python -m data_pipeline.builtin rcdb --out mine --set num_classes=...` then `make launch
    SET="data.train=mine/rcdb/train"`: the refusal offered only to delete the user's set. It names the recipe's
    settings that train on it as it is, and they do. `python -m pretrain.train` trained on such a folder without a
    word; it refuses it as the launch does."""
    from cluster.local_data import check_local_data
    from pretrain.config.train_config import load_config

    sizes = dict(num_classes=4, images_per_class=4, val_per_class=1)
    folder = builtin.ensure("rcdb", tmp_path / "mine", **sizes)
    config = load_config("local_demo", [f"data.train={folder}/train", "data.streams=2"])
    keep = " ".join(f"data.builtin_options.{k}={v}" for k, v in sizes.items())
    where = re.escape(str(folder))
    said = (
        rf"{where}/train was generated with num_classes=4 \(wanted 64\), .*; to train on it as it is, set {keep}; to "
        rf"generate it at the recipe's settings, delete it \(rm -r {where}\) or use another data.train"
    )
    for check in (lambda: check_local_data(config, None), config.data.ensure_builtin):  # make launch; pretrain.train
        with pytest.raises(ValueError, match=said):
            check()
    config = load_config("local_demo", [f"data.train={folder}/train", "data.streams=2", *keep.split()])
    assert check_local_data(config, None) == {folder: True}
    config.data.ensure_builtin()  # nothing to generate
