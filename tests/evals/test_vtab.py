"""VTAB registry and aggregation: coverage is always stated, missing tasks never enter a mean."""

import math
from dataclasses import replace

import numpy as np
import pytest

from evals.finetune import FinetuneOptions, train_val_split
from evals.vtab import CI_TASKS, GROUPS, VTAB1K_TASKS, aggregate, vtab_indices


def test_registry_matches_the_paper():
    assert len(VTAB1K_TASKS) == 19
    counts = {g: sum(t.group == g for t in VTAB1K_TASKS.values()) for g in GROUPS}
    assert counts == {"natural": 7, "specialized": 4, "structured": 8}
    classes = {n: t.num_classes for n, t in VTAB1K_TASKS.items()}
    assert classes["caltech101"] == 102 and classes["sun397"] == 397 and classes["clevr_count"] == 8
    assert classes["dsprites_loc"] == classes["dsprites_ori"] == 16 and classes["smallnorb_azim"] == 18
    assert set(CI_TASKS) == {"digits", "dsprites_loc", "dsprites_ori", "shapes_count"}


def test_aggregate_mixed_present_and_missing():
    scores = {"cifar100": 0.8, "svhn": 0.6, "eurosat": 0.9, "dsprites_loc": 0.5, "clevr_count": None}
    rows = {r["metric"]: r for r in aggregate(scores, VTAB1K_TASKS)}
    mean = rows["vtab/mean"]
    assert mean["value"] == pytest.approx((0.8 + 0.6 + 0.9 + 0.5) / 4)
    assert (mean["count"], mean["expected"], mean["count_metric"]) == (4, 19, "vtab/num_tasks")
    assert mean["detail"].startswith("VTAB mean over 4/19 tasks (missing: caltech101")
    assert "clevr_count" in mean["detail"]  # explicitly None counts as missing
    assert rows["vtab/natural"]["value"] == pytest.approx(0.7) and rows["vtab/natural"]["count"] == 2
    assert rows["vtab/natural"]["detail"].startswith("Natural mean over 2/7 tasks")
    assert rows["vtab/specialized"]["value"] == pytest.approx(0.9) and rows["vtab/specialized"]["expected"] == 4
    assert rows["vtab/structured"]["value"] == pytest.approx(0.5) and rows["vtab/structured"]["count"] == 1
    assert rows["vtab/structured"]["count_metric"] == "vtab/structured_num_tasks"


def test_aggregate_nothing_present_is_nan_not_zero():
    rows = {r["metric"]: r for r in aggregate({}, VTAB1K_TASKS)}
    assert math.isnan(rows["vtab/mean"]["value"]) and rows["vtab/mean"]["count"] == 0
    assert rows["vtab/mean"]["detail"].startswith("VTAB mean over 0/19 tasks")


def test_aggregate_full_coverage_and_unknown_task():
    scores = {n: 0.5 for n in VTAB1K_TASKS}
    rows = {r["metric"]: r for r in aggregate(scores, VTAB1K_TASKS)}
    assert rows["vtab/mean"]["detail"] == "VTAB mean over 19/19 tasks" and rows["vtab/mean"]["value"] == 0.5
    with pytest.raises(ValueError, match="outside the benchmark.*imagenet"):
        aggregate({"imagenet": 0.8}, VTAB1K_TASKS)


def test_train800_val200_draw():
    tr, va = vtab_indices(1297, 800, 200, seed=0)
    assert len(tr) == 800 and len(va) == 200 and not set(tr) & set(va)
    again, _ = vtab_indices(1297, 800, 200, seed=0)
    assert np.array_equal(tr, again)
    assert not np.array_equal(tr, vtab_indices(1297, 800, 200, seed=1)[0])
    with pytest.raises(ValueError, match="has 900 images but VTAB needs 1000"):
        vtab_indices(900, 800, 200, seed=0)


def test_finetune_at_the_vtab1k_budget_draws_the_same_800_and_200():
    opts = FinetuneOptions(train_examples=800, val_examples=200, seed=0)
    tr, va = train_val_split(1297, opts)  # digits' train split holds 1297 images
    assert (len(tr), len(va)) == (800, 200) and not set(tr) & set(va) and set(tr) | set(va) <= set(range(1297))
    again = train_val_split(1297, opts)
    assert np.array_equal(tr, again[0]) and np.array_equal(va, again[1])  # deterministic
    vtab = vtab_indices(1297, 800, 200, seed=0)  # type: finetune and type: vtab hold out the same 200
    assert np.array_equal(tr, vtab[0]) and np.array_equal(va, vtab[1])
    assert not np.array_equal(va, train_val_split(1297, replace(opts, seed=1))[1])
    keep, held = train_val_split(1297, FinetuneOptions())  # without a budget: all of train, 10% held out
    assert (len(keep), len(held)) == (1167, 130) and not set(keep) & set(held)


@pytest.mark.parametrize("protocol", ["linear_probe", "finetune"])
def test_a_test_split_declaring_other_classes_than_train_is_refused(
    eval_data_root, one_torch_thread, tmp_path, protocol
):
    """Before, a task folder whose test split declares another label space (here dsprites_loc's 16 classes beside
    digits' 10 in train) was scored: the head or ridge knows 10 classes, so every test image of class 10..15 counted
    as wrong, silently. type: fewshot and type: finetune refuse it; so does type: vtab now, before any work."""
    import shutil

    from evals.evaluator import EvalContext
    from evals.vtab import VtabOptions, evaluate
    from pretrain.model.vit import build_model

    shutil.copytree(eval_data_root / "digits" / "train", tmp_path / "data" / "digits" / "train")
    shutil.copytree(eval_data_root / "dsprites_loc" / "test", tmp_path / "data" / "digits" / "test")
    model = build_model("vit_tiny_debug").eval()
    ctx = EvalContext(
        model=model,
        load_model=lambda image_size=None: build_model("vit_tiny_debug"),
        data_root=tmp_path / "data",
        step=0,
        out_dir=tmp_path / "out",
        log=lambda _: None,
    )
    finetune = FinetuneOptions(steps=1, batch_size=8, lr_grid=(0.01,), warmup_steps=0)
    opts = VtabOptions(
        benchmark="ci", tasks=("digits",), train_examples=30, val_examples=10, protocol=protocol, finetune=finetune
    )
    with pytest.raises(ValueError, match=r"vtab task digits: .*declares 10 classes but .*declares 16; both splits"):
        evaluate(ctx, opts)


def test_the_linear_probe_draws_over_the_manifests_count_as_finetune_does(tmp_path, one_torch_thread):
    """Before, the linear probe drew train/val over the samples the stream read: one damaged JPEG in the split, never
    drawn, gave it another draw altogether, and another score, while type: vtab finetune kept its draw over the
    manifest's count (docs/vtab.md). Now both draw over the manifest's count, at stream positions."""
    import contextlib

    import torch

    from evals.evaluator import EvalContext
    from evals.vtab import VtabOptions, evaluate
    from pretrain.model.vit import build_model
    from tests.data_pipeline.test_stream import jpeg_bytes, make_shards

    def images(corrupt_key: str | None):
        def member(key, index, sample):
            sample["jpg"] = jpeg_bytes(index, (32, 32))
            if key == corrupt_key:
                sample["jpg"] = sample["jpg"][: len(sample["jpg"]) // 3]  # truncated: the stream skips it
            return sample

        return member

    opts = VtabOptions(benchmark="ci", tasks=("digits",), train_examples=30, val_examples=10, batch_size=32)
    tr, va = vtab_indices(128, 30, 10, opts.seed)
    assert 127 not in {*tr, *va}  # the last of the 128 samples is not drawn: damaging it changes nothing drawn
    scores = []
    for root, corrupt in ((tmp_path / "clean", None), (tmp_path / "damaged", "000127")):
        make_shards(root / "digits" / "train", member=images(corrupt))
        make_shards(root / "digits" / "test", member=images(None))
        torch.manual_seed(0)
        model = build_model("vit_tiny_debug").eval()
        ctx = EvalContext(
            model=model,
            load_model=lambda image_size=None, model=model: model,
            data_root=root,
            step=0,
            out_dir=tmp_path / "out",
            log=lambda _: None,
        )
        with pytest.warns(UserWarning, match="could not read every sample") if corrupt else contextlib.nullcontext():
            rows = {r.metric: r for r in evaluate(ctx, opts).rows}
        scores.append(rows["vtab/digits"].value)
    assert scores[0] == scores[1]
