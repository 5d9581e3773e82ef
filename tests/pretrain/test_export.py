"""`python -m pretrain.weights export`: weights out to transformers (`--format hf`) and the official `.npz` layout.

HF: every registered ViT size and patch (Ti/S/B/L/H, /32 /16 /14 /8; two blocks each, so that the layer numbering
is exercised without H's 632M parameters) loads with `transformers.ViTForImageClassification.from_pretrained` and
gives our logits; a headless model loads as a ViTModel; what HF's ViT cannot hold is refused with the reason and
nothing written. npz: the arrays are exactly the official names and layouts (`weights_npz_reference`, written from
the official code, not from ours), an independent NumPy forward of them gives our logits, and `load_npz` reads them
back to the same tensors, for every kind of model (pre-logits, gap, hybrids, no head). Sources: a checkpoint, a run
folder (its newest COMPLETE checkpoint), a damaged checkpoint (refused), an exported folder and an official .npz.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from evals.runner import open_checkpoint
from pretrain.checkpoint import checksums
from pretrain.checkpoint.run_folder import COMPLETE, TrainerState
from pretrain.model.vit import MODEL_NAMES, VARIANTS, VisionTransformer, model_config
from pretrain.weights.__main__ import main
from pretrain.weights.formats import load_model, load_npz, save_pretrained
from tests.support.weights_npz_reference import arrays_from_model, official_arrays, reference_logits

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
transformers = pytest.importorskip("transformers")

PLAIN_VITS = [name for name in MODEL_NAMES if VARIANTS[name][2] is None and name != "vit_tiny_debug"]


def _random(config) -> VisionTransformer:
    """A model whose every weight is drawn (no zero head or unit LayerNorm hides a misplaced tensor)."""
    torch.manual_seed(0)
    model = VisionTransformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05 if p.ndim > 1 else 0.2)
    return model.eval()


def _images(model: VisionTransformer, n: int = 2) -> torch.Tensor:
    side = model.config.image_size
    return torch.rand(n, model.config.in_chans, side, side, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def _export(source: Path | str, out: Path | str, *flags: str, capsys=None) -> int:
    """The exit status of `python -m pretrain.weights export SOURCE OUT FLAGS` (argparse's own errors included)."""
    try:
        status = main(["export", str(source), str(out), *flags])
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 2
    if capsys is not None:
        capsys.readouterr()
    return status


# --------------------------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("name", PLAIN_VITS)
def test_every_vit_size_and_patch_loads_in_transformers_with_our_logits(name, tmp_path, capsys):
    patch = VARIANTS[name][1]
    model = _random(model_config(name, depth=2, image_size=2 * patch, num_classes=5))
    save_pretrained(model, tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "hf", "--format", "hf", capsys=capsys) == 0
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    images = _images(model)
    with torch.no_grad():
        assert _relative(hf(pixel_values=images).logits, model(images)) <= 1e-4
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
    ]


@pytest.mark.parametrize("gelu", ["tanh", "none"])
def test_gelu_form_dropout_and_labels_survive_the_round_trip(gelu, tmp_path, capsys):
    config = model_config("vit_tiny_debug", num_classes=3, gelu_approximate=gelu, dropout=0.1, attention_dropout=0.05)
    model = _random(config)
    save_pretrained(model, tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys) == 0  # --format hf is the default
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.hidden_act == {"tanh": "gelu_pytorch_tanh", "none": "gelu"}[gelu]
    assert hf.config.layer_norm_eps == 1e-6 and hf.config.num_labels == 3
    images = _images(model)
    with torch.no_grad():
        assert _relative(hf(pixel_values=images).logits, model(images)) <= 1e-4
    again = load_model(tmp_path / "hf")  # an HF folder is a source vitscale reads too
    assert again.config == config
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_preprocessor_maps_pixels_to_what_the_model_was_trained_on(tmp_path, capsys):
    model = _random(model_config("vit_tiny_debug", num_classes=4))
    save_pretrained(model, tmp_path / "ours")
    _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys)
    settings = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert settings["size"] == {"height": 32, "width": 32} and settings["image_processor_type"] == "ViTImageProcessor"
    pixels = np.arange(256, dtype=np.float64)  # x / 255 → normalize(0.5, 0.5) must be vitscale's x / 127.5 - 1
    scaled = (pixels * settings["rescale_factor"] - settings["image_mean"][0]) / settings["image_std"][0]
    assert np.allclose(scaled, pixels / 127.5 - 1, atol=1e-12)


def test_headless_model_is_a_vitmodel_whose_class_token_is_our_features(tmp_path, capsys):
    model = _random(model_config("vit_s32", depth=2, image_size=64, num_classes=0))
    save_pretrained(model, tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["ViTModel"]
    hf = transformers.ViTModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False).eval()
    images = _images(model)
    with torch.no_grad():
        assert _relative(hf(pixel_values=images).last_hidden_state[:, 0], model(images)) <= 1e-4


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(pool="gap"), r"pool='gap' \(HF ViT classifies from the class token\)"),
        (dict(representation_size=16), r"a pre-logits layer \(representation_size=16"),
        (dict(hybrid_stages=(1,), patch_size=1, image_size=32), r"a ResNet hybrid stem \(hybrid_stages=\(1,\)"),
    ],
)
def test_what_hf_cannot_hold_is_refused_with_the_reason(overrides, reason, tmp_path, capsys):
    save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4, **overrides)), tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "hf", "--format", "hf") == 2
    out, err = capsys.readouterr()
    assert not out and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("python -m pretrain.weights: error: cannot express in HF ViTForImageClassification")
    assert re.search(reason, err) and "--format npz" in err
    assert not (tmp_path / "hf").exists()  # refused before anything is written


# --------------------------------------------------------------------------------------------- official .npz


NPZ_MODELS = {
    "token_head": dict(name="vit_tiny_debug", num_classes=5),
    "pre_logits_i21k": dict(name="vit_tiny_debug", num_classes=7, representation_size=24, head_bias_init=-10.0),
    "gap": dict(name="vit_tiny_debug", num_classes=3, pool="gap"),
    "no_head": dict(name="vit_s32", depth=2, image_size=64, num_classes=0),
    "hybrid": dict(name="vit_tiny_debug", hybrid_stages=(1, 1), hybrid_width=0.5, patch_size=1, num_classes=4),
}


@pytest.mark.parametrize("case", list(NPZ_MODELS))
def test_npz_export_is_the_official_layout_and_loads_back_identically(case, tmp_path, capsys):
    fields = dict(NPZ_MODELS[case])
    model = _random(model_config(fields.pop("name"), **fields))
    save_pretrained(model, tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "ours.npz", "--format", "npz", capsys=capsys) == 0
    with np.load(tmp_path / "ours.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    official = arrays_from_model(model)  # the test helper's own mapping, written from the official code
    assert arrays.keys() == official.keys()
    for key, value in official.items():
        assert arrays[key].dtype == np.float32 and np.array_equal(arrays[key], value), key
    images = _images(model)
    stages = model.config.hybrid_stages
    with torch.no_grad():
        ours = model(images).double().numpy()
        reference = reference_logits(arrays, images.permute(0, 2, 3, 1).numpy(), layout="vt", stages=stages)
        assert np.abs(reference - ours).max() <= 1e-4 * np.abs(reference).max()
        back = load_npz(tmp_path / "ours.npz")
        assert torch.equal(back(images), model(images))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_official_npz_exports_to_hf_and_back_to_npz_unchanged(tmp_path, capsys):
    arrays = official_arrays(num_classes=6)
    np.savez(tmp_path / "official.npz", **arrays)
    assert _export(tmp_path / "official.npz", tmp_path / "hf", capsys=capsys) == 0
    assert _export(tmp_path / "hf", tmp_path / "again", "--format", "npz", capsys=capsys) == 0
    assert (tmp_path / "again").is_file()  # OUT names the file exactly: no ".npz" is added
    with np.load(tmp_path / "again", allow_pickle=False) as npz:
        again = {k: npz[k] for k in npz.files}
    assert again.keys() == arrays.keys()
    assert all(np.array_equal(again[k], v) for k, v in arrays.items())
    (tmp_path / "folder").mkdir()
    _export(tmp_path / "hf", tmp_path / "folder", "--format", "npz", capsys=capsys)  # a folder gets model.npz
    assert (tmp_path / "folder" / "model.npz").is_file()


def test_exact_gelu_is_refused_by_npz(tmp_path, capsys):
    save_pretrained(_random(model_config("vit_tiny_debug", gelu_approximate="none")), tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "x.npz", "--format", "npz") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "gelu_approximate='none'" in err and "--format hf" in err
    assert not (tmp_path / "x.npz").exists()


# --------------------------------------------------------------------------------------------- sources


def _checkpoint(run: Path, step: int, model: VisionTransformer, complete: bool = True) -> Path:
    """A checkpoint folder as the trainer leaves it, as far as an export reads it (weights, state, checksums)."""
    folder = run / "checkpoints" / f"step_{step:08d}"
    save_pretrained(model, folder)
    TrainerState(
        step=step, images_seen=step * 8, world_size=1, deepspeed_tag=folder.name, stream_state={}, rng_states=()
    ).write(folder)
    files = ("model.safetensors", "model.json", "trainer_state.json")
    checksums.write(folder, {name: checksums.entry(folder / name) for name in files})
    if complete:
        (folder / COMPLETE).write_text("")
    return folder


def test_a_run_folder_means_its_newest_complete_checkpoint_to_export_load_and_evals(tmp_path, capsys):
    models = {step: _random(model_config("vit_tiny_debug", num_classes=4, depth=1 + step)) for step in (1, 2, 3)}
    for step, model in models.items():
        _checkpoint(tmp_path / "run", step, model, complete=step < 3)
    for source in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        assert _export(source, tmp_path / "hf", capsys=capsys) == 0
        assert transformers.ViTConfig.from_pretrained(tmp_path / "hf").num_hidden_layers == 3  # step 2's model
        assert load_model(source).config.depth == 3
        load, step, out, path = open_checkpoint(source)
        assert (step, path.name, out) == (2, "step_00000002", path / "evals") and load().config.depth == 3
    assert _export(tmp_path / "run" / "checkpoints" / "step_00000003", tmp_path / "x") == 2
    assert "has no COMPLETE marker" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_refused(tmp_path, capsys):
    folder = _checkpoint(tmp_path / "run", 5, _random(model_config("vit_tiny_debug", num_classes=4)))
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert _export(folder, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is damaged" in err and "model.safetensors" in err


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error_line(capsys, *expected: str) -> str:
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "Traceback" not in err, out + err
    assert err.startswith("python -m pretrain.weights: error: ") and all(re.search(e, err) for e in expected), err
    return err


def test_export_never_writes_over_a_checkpoint_run_weights_folder_or_its_source(tmp_path, capsys):
    model = _random(model_config("vit_tiny_debug", num_classes=4))
    newest = _checkpoint(tmp_path / "run", 2, model)
    save_pretrained(model, tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys) == 0
    before = {name: _contents(tmp_path / name) for name in ("run", "ours", "hf")}
    cases = {  # (SOURCE, OUT) → what the one line names
        ("run", "run/checkpoints/step_00000002"): r"step_00000002 is SOURCE itself",
        ("ours", "run/checkpoints/step_00000002"): r"step_00000002 holds COMPLETE, .*pass a new or empty folder",
        ("hf", "run"): r"run holds checkpoints, .*pass a new or empty folder",
        ("hf", "ours"): r"ours holds model.json, .*pass a new or empty folder",
        ("hf", "hf"): r"hf is SOURCE itself",
    }
    for (source, out), expected in cases.items():
        assert _export(tmp_path / source, tmp_path / out) == 2, (source, out)
        _one_error_line(capsys, expected)
    assert {name: _contents(tmp_path / name) for name in before} == before
    assert checksums.verify(newest).ok
    (tmp_path / "empty").mkdir()
    for out in ("hf", "empty"):  # an earlier export's folder is written again; an empty one is fine
        assert _export(tmp_path / "run", tmp_path / out, capsys=capsys) == 0
        assert transformers.ViTConfig.from_pretrained(tmp_path / out).num_labels == 4


def test_npz_export_refuses_a_file_that_is_no_npz_and_its_source(tmp_path, capsys):
    save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4)), tmp_path / "ours")
    (tmp_path / "notes.txt").write_text("my notes\n")
    assert _export(tmp_path / "ours", tmp_path / "notes.txt", "--format", "npz") == 2
    _one_error_line(capsys, r"notes.txt exists and is not an .npz archive")
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"
    assert _export(tmp_path / "ours", tmp_path / "ours.npz", "--format", "npz", capsys=capsys) == 0
    assert _export(tmp_path / "ours.npz", tmp_path / "ours.npz", "--format", "npz") == 2
    _one_error_line(capsys, r"ours.npz is SOURCE itself")
    assert _export(tmp_path / "ours", tmp_path / "ours.npz", "--format", "npz", capsys=capsys) == 0  # written again


def test_npz_export_never_puts_its_file_into_a_checkpoint_run_or_source_folder(tmp_path, capsys):
    """A folder OUT gets model.npz: the source checkpoint, its run or ``checkpoints/`` would keep a stray file that
    checkpoint retention deletes with the folder, so they are refused as for --format hf."""
    newest = _checkpoint(tmp_path / "run", 2, _random(model_config("vit_tiny_debug", num_classes=4)))
    before = _contents(tmp_path / "run")
    cases = {
        newest: r"step_00000002 is SOURCE itself",
        tmp_path / "run": r"run holds checkpoints, .*pass a new or empty folder",
        tmp_path / "run" / "checkpoints": r"checkpoints holds step_00000002, .*pass a new or empty folder",
    }
    # A file path there too: the checkpoint (SOURCE) and the run's checkpoints/; the run's own folder is not deleted.
    stray = r"model.npz would be a stray file in \S*{} \(SOURCE, a checkpoint or a run's checkpoints/"
    cases[newest / "model.npz"] = stray.format("step_00000002")
    cases[tmp_path / "run" / "checkpoints" / "w.npz"] = stray.replace("model", "w").format("checkpoints")
    for out, expected in cases.items():
        assert _export(newest, out, "--format", "npz") == 2, out
        _one_error_line(capsys, expected)
    assert _contents(tmp_path / "run") == before
    (tmp_path / "exports").mkdir()
    for _ in range(2):  # an empty folder, then the folder of an earlier export
        assert _export(newest, tmp_path / "exports", "--format", "npz", capsys=capsys) == 0
    assert [p.name for p in (tmp_path / "exports").iterdir()] == ["model.npz"]


@pytest.mark.parametrize("fmt", ["hf", "npz"])
def test_export_replaces_a_file_whole_never_rewriting_it_in_place(fmt, tmp_path, capsys):
    """Written beside and renamed over: a hard link to the old file keeps the old bytes, so a write cut short
    leaves the old file, never half of a new one."""
    for name, classes in (("first", 4), ("second", 3)):
        save_pretrained(_random(model_config("vit_tiny_debug", num_classes=classes)), tmp_path / name)
    out = tmp_path / ("out" if fmt == "hf" else "out.npz")
    assert _export(tmp_path / "first", out, "--format", fmt, capsys=capsys) == 0
    written = [out / "model.safetensors", out / "config.json"] if fmt == "hf" else [out]
    first = {}
    for i, path in enumerate(written):
        (tmp_path / f"link{i}").hardlink_to(path)
        first[path] = path.read_bytes()
    assert _export(tmp_path / "second", out, "--format", fmt, capsys=capsys) == 0
    for i, path in enumerate(written):
        assert (tmp_path / f"link{i}").read_bytes() == first[path] != path.read_bytes(), path
    assert [p.name for p in written[0].parent.iterdir() if ".tmp" in p.name] == []


def test_mlflow_run_and_checkpoint_are_checked_before_anything_is_written(tmp_path, capsys):
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4)), tmp_path / "ours")
    checkpoint = _checkpoint(tmp_path / "run", 2, _random(model_config("vit_tiny_debug", num_classes=4)))
    cases = {
        (tmp_path / "ours", "abc"): r"ours is no training checkpoint: only a checkpoint",
        (checkpoint, "0" * 32): r"MLflow run '0{32}' is not in sqlite:",
    }
    for (source, run), expected in cases.items():
        assert _export(source, tmp_path / "hf", "--mlflow-run", run, "--tracking-uri", uri) == 2
        out, err = capsys.readouterr()
        assert not out, out  # no "wrote ..."
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and re.search(expected, errors[0]) and "Traceback" not in err, err
        assert not (tmp_path / "hf").exists()


def test_empty_run_folder_file_out_and_npz_with_mlflow_are_clear_errors(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    save_pretrained(_random(model_config("vit_tiny_debug")), tmp_path / "ours")
    (tmp_path / "a_file").write_text("x")
    cases = {
        ("run", "hf"): r"run folder without a COMPLETE checkpoint",
        ("ours", "a_file"): r"OUT \S*a_file is a file; --format hf writes a folder",
    }
    for (source, out), expected in cases.items():
        assert _export(tmp_path / source, tmp_path / out) == 2
        assert re.search(expected, capsys.readouterr().err)
    assert _export(tmp_path / "ours", tmp_path / "o.npz", "--format", "npz", "--mlflow-run", "abc") == 2
    assert "use it with --format hf" in capsys.readouterr().err


def test_python_m_export_refusal_is_one_line_without_traceback(tmp_path):
    save_pretrained(_random(model_config("vit_tiny_debug", pool="gap")), tmp_path / "ours")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pretrain.weights", "export", str(tmp_path / "ours"), str(tmp_path / "hf")]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout, proc.stderr
    assert proc.stderr.count("\n") == 1 and "pool='gap'" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------- writing


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664)], ids=["umask022", "umask002"])
def test_written_weights_get_the_mode_of_any_new_file(umask, mode, tmp_path, capsys):
    """safetensors writes its file 0600 whatever the umask: colleagues could read config.json but not the weights."""
    old = os.umask(umask)
    try:
        save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4)), tmp_path / "ours")  # checkpoints too
        assert _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys) == 0
    finally:
        os.umask(old)
    for folder in ("ours", "hf"):
        assert stat.S_IMODE((tmp_path / folder / "model.safetensors").stat().st_mode) == mode, folder


def test_a_failed_write_is_one_line_and_leaves_no_new_folder(tmp_path, capsys):
    """A full disk (here: a file size limit) during --format hf or convert gave SafetensorError's traceback and
    left an empty OUT."""
    save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4)), tmp_path / "ours")
    np.savez(tmp_path / "official.npz", **official_arrays(num_classes=6))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, limit[1]))
    try:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
        statuses = [
            _export(tmp_path / "ours", tmp_path / "new" / "hf"),
            _export(tmp_path / "ours", tmp_path / "new" / "npz" / "w.npz", "--format", "npz"),
            main(["convert", str(tmp_path / "official.npz"), str(tmp_path / "new" / "converted")]),
        ]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    out, err = capsys.readouterr()
    assert statuses == [2, 2, 2] and not out and err.count("\n") == 3 and "Traceback" not in err, err
    for line, name in zip(err.splitlines(), ("hf/model.safetensors", "w.npz", "converted/model.safetensors")):
        assert re.search(
            rf"error: cannot write \S*{name}: .*File too large.*; make room there or write elsewhere", line
        ), line
    assert not (tmp_path / "new").exists()


def test_an_earlier_export_with_eval_results_is_written_again(tmp_path, capsys):
    """`python -m evals.run --weights OUT` adds OUT/evals/: the next export there was refused."""
    save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4)), tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys) == 0
    (tmp_path / "hf" / "evals").mkdir()
    (tmp_path / "hf" / "evals" / "local_fewshot.parquet").write_bytes(b"results")
    assert _export(tmp_path / "ours", tmp_path / "hf", capsys=capsys) == 0
    assert (tmp_path / "hf" / "evals" / "local_fewshot.parquet").read_bytes() == b"results"
    (tmp_path / "other" / "evals").mkdir(parents=True)  # eval results without an export beside them
    assert _export(tmp_path / "ours", tmp_path / "other") == 2
    _one_error_line(capsys, r"other holds evals, ")


def test_what_hf_cannot_hold_in_an_npz_is_not_sent_back_to_npz(tmp_path, capsys):
    np.savez(tmp_path / "i21k.npz", **official_arrays(representation_size=24, num_classes=11))
    assert _export(tmp_path / "i21k.npz", tmp_path / "hf") == 2
    err = _one_error_line(capsys, r"pre-logits layer", r"SOURCE is already an official .npz")
    assert "--format npz" not in err and not (tmp_path / "hf").exists()


def test_npz_out_ending_in_a_slash_is_a_folder_that_gets_model_npz(tmp_path, capsys):
    save_pretrained(_random(model_config("vit_tiny_debug", num_classes=4)), tmp_path / "ours")
    assert _export(tmp_path / "ours", f"{tmp_path / 'new'}/", "--format", "npz", capsys=capsys) == 0
    assert (tmp_path / "new" / "model.npz").is_file()
    (tmp_path / "a_file").write_text("x")
    assert _export(tmp_path / "ours", f"{tmp_path / 'a_file'}/", "--format", "npz") == 2
    _one_error_line(capsys, r"a_file/ names a folder, but \S*a_file is a file")


def test_hf_export_and_convert_never_write_into_a_runs_checkpoints(tmp_path, capsys):
    """A folder there is a checkpoint's or lies among them: retention and the next save delete it."""
    _checkpoint(tmp_path / "run", 2, _random(model_config("vit_tiny_debug", num_classes=4)))
    np.savez(tmp_path / "official.npz", **official_arrays(num_classes=6))
    before = _contents(tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    cases = {
        ("export", checkpoints / "step_00000600" / "hf"): r"stray folder in \S*checkpoints \(SOURCE, a checkpoint",
        ("export", checkpoints / "step_00000002" / "hf"): r"stray folder in \S*step_00000002 ",
        ("convert", checkpoints / "step_00000700"): r"stray folder in \S*checkpoints ",
    }
    for (command, out), expected in cases.items():
        assert main([command, str(tmp_path / "official.npz"), str(out)]) == 2, out
        _one_error_line(capsys, expected)
    assert _contents(tmp_path / "run") == before and [p.name for p in checkpoints.iterdir()] == ["step_00000002"]


def test_an_npz_init_from_of_another_architecture_is_refused_by_the_dry_run(tmp_path, capsys):
    """A folder's model.json was checked where the recipe is; an .npz only in every rank, after the start."""
    from pretrain.config.train_config import load_config

    np.savez(tmp_path / "other.npz", **official_arrays(num_classes=6))  # width 32, depth 2
    config = load_config("local_demo", [f"checkpoint.init_from={tmp_path / 'other.npz'}"])
    with pytest.raises(ValueError, match=r"init_from=\S*other.npz: its weights are of another architecture .*width 32"):
        config.validate(2)
    save_pretrained(_random(model_config("vit_tiny_debug")), tmp_path / "ours")
    assert _export(tmp_path / "ours", tmp_path / "same.npz", "--format", "npz", capsys=capsys) == 0
    load_config("local_demo", [f"checkpoint.init_from={tmp_path / 'same.npz'}"]).validate(2)


# --------------------------------------------------------------------------------------------- HTTP sources


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass


def test_an_http_source_is_fetched_naming_its_url_and_an_unreachable_one_is_one_line(tmp_path, monkeypatch, capsys):
    """The fetch printed `fetching http://http:/127.0.0.1:PORT`; a server that is down read as "nothing there"."""
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "served").mkdir()
    np.savez(tmp_path / "served" / "official.npz", **official_arrays(num_classes=6))
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Files, directory=str(tmp_path / "served"))
    )
    url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _export(f"{url}/official.npz", tmp_path / "hf") == 0
        assert f"fetching {url}: 1 file(s)" in capsys.readouterr().out
        assert _export(f"{url}/absent.npz", tmp_path / "hf") == 2
        _one_error_line(capsys, r"absent.npz: nothing there")
    finally:
        server.shutdown()
        server.server_close()
    assert _export(f"{url}/official.npz", tmp_path / "again") == 2
    _one_error_line(capsys, rf"{url}/official.npz: the server could not be reached \(.*\); check the host and port")
