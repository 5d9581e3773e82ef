"""Fine-tuning evals hold only the drawn train images (uint8) and one test batch: the same numbers as a split held
whole in memory as float32, and a peak memory set by the batch, not by the split's size."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.builtin.sets import ensure
from data_pipeline.stream.augment import to_float_images
from evals.features import StreamedSplit, load_drawn, load_images
from evals.finetune import FinetuneOptions, accuracy, accuracy_over, train_classifier, vtab_indices
from pretrain.model.vit import build_model, model_config
from pretrain.weights.formats import save_pretrained

PROJECT = Path(__file__).resolve().parents[2]
MIB = 2**20


def test_a_streamed_test_split_scores_as_the_split_in_memory(eval_data_root, one_torch_thread):
    """Batch by batch, the streamed split gives the in-memory slices' pixels and logits bit for bit, so the same
    accuracy; the last batch is partial (500 test images in batches of 64)."""
    test = eval_data_root / "digits" / "test"
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=10).eval()
    images, labels, _ = load_images(test, image_size=32, batch_size=64)
    streamed = StreamedSplit(test, image_size=32, batch_size=64)
    start = 0
    with torch.inference_mode():
        for batch_images, batch_labels in streamed:
            stop = start + len(batch_labels)
            assert torch.equal(batch_images, images[start:stop]) and np.array_equal(batch_labels, labels[start:stop])
            assert torch.equal(model(batch_images), model(images[start:stop]))
            start = stop
    assert start == len(labels) == 500
    assert accuracy_over(model, streamed) == accuracy(model, images, labels, batch_size=64)


@pytest.mark.usefixtures("only_new_objects_scanned")  # each gc.collect walks what the test made, not the whole heap
def test_one_fine_tuned_model_is_alive_at_a_time():
    """Each lr run's model, with its gradients, is gone before the next run makes its own: on a GPU two would hold
    8 bytes per parameter more than the plan's 12 (weights, gradients, momentum: docs/vtab.md)."""
    import gc
    import weakref

    from evals.finetune import select_lr_and_evaluate

    gen = torch.Generator().manual_seed(0)
    pixels, labels = torch.randint(0, 256, (24, 3, 32, 32), dtype=torch.uint8, generator=gen), np.arange(24) % 3
    made, alive_at_make = [], []

    def make_model():
        gc.collect()  # what stays alive is referenced, not merely uncollected
        alive_at_make.append(sum(ref() is not None for ref in made))
        model = build_model("vit_tiny_debug")
        made.append(weakref.ref(model))
        return model

    opts = FinetuneOptions(steps=2, batch_size=8, warmup_steps=1, lr_grid=(0.01, 0.03, 0.1))
    train, val = (pixels[:16], labels[:16]), (pixels[16:], labels[16:])
    select_lr_and_evaluate(make_model, train, val, [(pixels, labels)], num_classes=3, opts=opts)
    assert alive_at_make == [0, 0, 0, 0]  # three lr runs and the final one


def test_drawn_uint8_images_train_and_score_as_the_float_split(eval_data_root, one_torch_thread):
    """The VTAB draw read in as uint8 converts to the float split's rows exactly; fine-tuning on it (crops and
    flips on) ends in the same parameters, and the held-out accuracy is the same."""
    train = eval_data_root / "digits" / "train"
    images, labels, info = load_images(train, image_size=32)
    tr, va = vtab_indices(info.num_samples, 80, 20, seed=0)
    pixels, drawn_labels, _ = load_drawn(train, np.concatenate([tr, va]), image_size=32, batch_size=64)
    assert pixels.dtype == torch.uint8 and pixels.shape == (100, 3, 32, 32)
    assert torch.equal(to_float_images([pixels]), images[np.concatenate([tr, va])])
    assert np.array_equal(drawn_labels, labels[np.concatenate([tr, va])])

    opts = FinetuneOptions(steps=3, batch_size=16, warmup_steps=1, crop_padding=2, flip=True)

    def finetune(x, y):
        torch.manual_seed(1)
        model = build_model("vit_tiny_debug", num_classes=32)
        return train_classifier(model, x, y, num_classes=10, lr=0.03, steps=3, opts=opts)[0]

    on_uint8, on_float = finetune(pixels[:80], drawn_labels[:80]), finetune(images[tr], labels[tr])
    assert all(torch.equal(a, b) for a, b in zip(on_uint8.state_dict().values(), on_float.state_dict().values()))
    assert accuracy(on_uint8, pixels[80:], drawn_labels[80:]) == accuracy(on_float, images[va], labels[va])
    with pytest.raises(ValueError, match=r"positions to draw must lie in 0\.\.1296"):
        load_drawn(train, [0, info.num_samples], image_size=32)


# The child: the suite (a VTAB-style fine-tune on dsprites_loc) through the runner, then its own peak RSS.
CHILD = """
import resource, sys
from evals.runner import run_suite
table = run_suite(sys.argv[1], sys.argv[2], data_root=sys.argv[3], out=sys.argv[4], num_threads=1, log=lambda m: None)
print(next(r["count"] for r in table.to_pylist() if r["metric"] == "vtab/num_tasks"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
"""

SUITE = """name: memory
evaluators:
  - type: vtab
    benchmark: ci
    tasks: [dsprites_loc]
    protocol: finetune
    train_examples: 80
    val_examples: 20
    batch_size: 64
    finetune: {steps: 2, batch_size: 16, lr_grid: [0.01], warmup_steps: 1, eval_batch_size: 64}
"""


def _peak_rss(checkpoint: Path, suite: Path, data_root: Path, out: Path) -> int:
    """Peak resident bytes of a fresh process that runs ``suite`` on ``data_root``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT)}
    args = [sys.executable, "-c", CHILD, str(checkpoint), str(suite), str(data_root), str(out)]
    done = subprocess.run(args, capture_output=True, text=True, cwd=PROJECT, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    covered, peak_kib = done.stdout.split()[-2:]
    assert covered == "1"  # the task was scored, not reported missing
    return int(peak_kib) * 1024


@pytest.mark.timeout(300)
def test_peak_memory_of_a_finetune_eval_is_set_by_the_batch_not_the_split(tmp_path):
    """Peak RSS (ru_maxrss of a fresh child per run; tracemalloc would miss torch's allocations, which bypass
    Python's allocator) of a VTAB-style fine-tune whose test split is 1000, then 2000 images at 128 px: 197 MB per
    1000 images as float32. Streamed, a run holds one test batch of 64 (12.6 MB float) and the 100 drawn train
    images (4.9 MB uint8). Measured on a shared 2-core machine: 537 MiB for either split under pytest, 417-433 MiB
    in repeated runs outside it (identical runs vary by ~16 MiB); the test split held whole as before (`load_images`
    in the child) went 649 -> 1025 MiB. Asserted: doubling the split raises the peak by under a quarter of its
    float size (49 MB)."""
    size, num_test = 128, 1000
    roots = {n: tmp_path / f"root_{n}" for n in (num_test, 2 * num_test)}
    for n, root in roots.items():  # the same train split; the larger test split starts with the smaller one
        ensure("dsprites_loc", root, resolution=size, num_train=200, num_test=n)
    torch.manual_seed(0)
    checkpoint = tmp_path / "weights"  # 16-px patches: 64 tokens at 128 px keep the forwards cheap
    save_pretrained(build_model("vit_tiny_debug", num_classes=16, patch_size=16, image_size=size, depth=1), checkpoint)
    suite = tmp_path / "memory.yaml"
    suite.write_text(SUITE)
    peak = {n: _peak_rss(checkpoint, suite, root, tmp_path / f"out_{n}") for n, root in roots.items()}
    split_bytes = num_test * 3 * size * size * 4  # the test images added, as float32
    growth = peak[2 * num_test] - peak[num_test]
    print(f"\npeak RSS {peak[num_test] / MIB:.0f} MiB -> {peak[2 * num_test] / MIB:.0f} MiB doubling the test split")
    assert growth < split_bytes / 4, (growth / MIB, split_bytes / MIB)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_shared_models_wait_on_the_host_while_a_finetune_trains(eval_data_root, one_torch_thread, device, tmp_path):
    """While `type: finetune` or VTAB's finetune protocol trains on the device, the shared model and its resized copy
    (frozen features at another size) are on the host: the plan counts only the fine-tuned model's 12 bytes per
    parameter there (docs/vtab.md, "Fine-tuning memory"), not 4 more per shared copy. Afterwards they are back on the
    device, the same parameters, and a later entry still reuses the features extracted before. On CPU the host is
    the device; the cuda case is the one that failed before."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from evals import fewshot, finetune, vtab
    from evals.evaluator import EvalContext
    from evals.features import RESIZED_MODEL
    from evals.runner import random_init

    # One block: where the models are is the check, not their depth; four made the feature passes ~3x dearer.
    seeded = random_init(model_config("vit_tiny_debug", num_classes=32, depth=1), seed=0)
    where = []  # per model the fine-tunes made: the devices the shared models' parameters were on meanwhile

    def shared():
        return [ctx.model, *(m for k, m in ctx.feature_cache.items() if isinstance(k, tuple) and k[0] == RESIZED_MODEL)]

    def load_model(image_size=None):
        where.append({p.device.type for m in shared() for p in m.parameters()})
        return seeded(image_size)

    quiet = dict(data_root=eval_data_root, step=0, out_dir=tmp_path, log=lambda _: None)
    ctx = EvalContext(model=seeded().eval().to(device), load_model=load_model, device=device, **quiet)
    probe = fewshot.FewshotOptions(datasets=("digits",), shots=(2,), seeds=(0,), image_size=48)
    first = [r.value for r in fewshot.evaluate(ctx, probe).rows]  # makes the 48 px copy, on the device
    models = shared()
    params, values = [list(m.parameters()) for m in models], [m.state_dict() for m in models]
    assert len(models) == 2 and {p.device.type for m in models for p in m.parameters()} == {device}
    cached, where[:] = len(ctx.feature_cache), []

    tune = dict(steps=1, batch_size=8, lr_grid=(0.01,), warmup_steps=0, eval_batch_size=250)
    finetune.evaluate(ctx, finetune.FinetuneOptions(datasets=("digits",), max_train_examples=40, **tune))
    ci = dict(benchmark="ci", tasks=("digits",), train_examples=30, val_examples=10, protocol="finetune")
    vtab.evaluate(ctx, vtab.VtabOptions(finetune=finetune.FinetuneOptions(**tune), **ci))
    assert where == [{"cpu"}] * 4  # (one lr + the final run) x two entries

    assert shared() == models and [list(m.parameters()) for m in models] == params
    assert {p.device.type for m in models for p in m.parameters()} == {device}
    assert all(not m.training for m in models)
    for model, before in zip(models, values):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    again = [r.value for r in fewshot.evaluate(ctx, probe).rows]
    assert again == first and len(ctx.feature_cache) == cached  # the features extracted before are reused


def test_features_cached_at_another_batch_size_are_not_reused(eval_data_root, one_torch_thread):
    """Features of another batch size differ in their last bits. Before, the cache ignored it: a suite's linear probe
    at batch_size 32 scored the features a fewshot entry had extracted at 256 before it, and other numbers alone."""
    from evals.features import extract_features

    test = eval_data_root / "digits" / "test"
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=0).eval()
    cache = {}
    other, _, _ = extract_features(model, test, batch_size=7, cache=cache)
    alone, _, _ = extract_features(model, test, batch_size=256)
    after, _, _ = extract_features(model, test, batch_size=256, cache=cache)
    assert after is not other and np.array_equal(after, alone)  # here 7 and 256 differ by ~5e-7
    assert extract_features(model, test, batch_size=256, cache=cache)[0] is after  # still cached per batch size
