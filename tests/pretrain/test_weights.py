"""pretrain.weights.formats: official npz import against an independent NumPy forward, resize, safetensors, HF
parity."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage
import torch

from pretrain.checkpoint.run_folder import IncompleteCheckpointError, latest_checkpoint
from pretrain.model.vit import VisionTransformer, ViTConfig, build_model
from pretrain.weights.__main__ import main
from pretrain.weights.export import save_hf
from pretrain.weights.formats import (
    from_hf_state_dict,
    hf_config,
    load_checkpoint_model,
    load_model,
    load_npz,
    load_pretrained,
    resize_pos_embed,
    save_pretrained,
    to_hf_state_dict,
)
from tests.support.weights_npz_reference import arrays_from_model, official_arrays, reference_logits

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _write(path, arrays, prefix=""):
    np.savez(path, **{prefix + k: v for k, v in arrays.items()})
    return path


def _logits(model, images_nhwc):
    with torch.no_grad():
        return model.eval()(torch.from_numpy(images_nhwc).permute(0, 3, 1, 2)).double().numpy()


def _relative_error(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


CASES = {
    "vt_token": (dict(), "", dict(pool="token", representation_size=None)),
    "vt_token_prelogits_i21k": (dict(representation_size=24, num_classes=11), "", dict(representation_size=24)),
    "bv_gap_params_prefix": (dict(layout="bv", pool="gap"), "params/", dict(pool="gap")),
    "bv_token_opt_target_prefix": (dict(layout="bv", num_classes=0), "opt/target/", dict(num_classes=0)),
    "hybrid_old_groupnorm": (
        dict(stages=(1, 2), patch=1, grid=2, old_groupnorm=True),
        "",
        dict(hybrid_stages=(1, 2), patch_size=1, image_size=16),
    ),
    "hybrid_4_stages_gap": (
        dict(stages=(1, 1, 1, 1), patch=1, grid=2, width=64, pool="gap"),
        "",
        dict(hybrid_stages=(1, 1, 1, 1), image_size=64),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_official_layouts_reproduce_reference_logits(tmp_path, case):
    kwargs, prefix, expected = CASES[case]
    arrays = official_arrays(**kwargs)
    model = load_npz(_write(tmp_path / "ckpt.npz", arrays, prefix))
    for field, value in expected.items():
        assert getattr(model.config, field) == value, field
    assert (model.config.depth, model.config.num_heads, model.config.mlp_dim) == (2, 4, 64)
    assert model.config.gelu_approximate == "tanh"
    size = model.config.image_size
    images = np.random.default_rng(1).uniform(-1, 1, (2, size, size, 3)).astype(np.float32)
    reference = reference_logits(arrays, images, layout=kwargs.get("layout", "vt"), stages=kwargs.get("stages"))
    assert _relative_error(_logits(model, images), reference) <= 1e-5


# Hybrids as the official code builds them: root int(64 * width_factor) channels (fractional factors included), 1-4
# stages, and the root alone (`num_layers=()`); stage widths follow the root (VT models_vit.py).
HYBRID_WIDTHS = [0.5, 1, 2]
HYBRID_STAGES = [(1,), (2, 1), (1, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("stages", HYBRID_STAGES, ids=lambda s: f"{len(s)}stages")
@pytest.mark.parametrize("width_factor", HYBRID_WIDTHS, ids=lambda w: f"wf{w}")
def test_hybrid_width_factors_and_stage_counts_reproduce_reference_logits(tmp_path, width_factor, stages):
    arrays = official_arrays(
        stages=stages, width_factor=width_factor, patch=1, grid=2, pool="gap" if len(stages) % 2 else "token"
    )
    model = load_npz(_write(tmp_path / "hybrid.npz", arrays, "params/"))
    assert model.config.hybrid_stages == stages and model.config.hybrid_width == width_factor
    assert model.patch_embed.backbone.conv_root.weight.shape[0] == int(64 * width_factor)
    size = model.config.image_size
    assert size == 2 * 4 * 2 ** (len(stages) - 1)  # a 2x2 grid of 1x1 patches behind the stem's stride
    images = np.random.default_rng(4).uniform(-1, 1, (2, size, size, 3)).astype(np.float32)
    assert _relative_error(_logits(model, images), reference_logits(arrays, images, stages=stages)) <= 1e-5


@pytest.mark.parametrize("width_factor", [1.5, 3])
def test_other_official_widths_and_the_root_only_stem_load(tmp_path, width_factor):
    for stages in ((), (1, 1)):  # () is the official `num_layers=()`: conv_root + max-pool, no stage (stride 4)
        arrays = official_arrays(stages=stages, width_factor=width_factor, patch=2, grid=2, seed=len(stages))
        model = load_npz(_write(tmp_path / "hybrid.npz", arrays))
        assert model.config.hybrid_stages == stages and model.config.hybrid_width == width_factor
        size = model.config.image_size
        images = np.random.default_rng(5).uniform(-1, 1, (1, size, size, 3)).astype(np.float32)
        assert _relative_error(_logits(model, images), reference_logits(arrays, images, stages=stages)) <= 1e-5


def _random_hybrid(width_factor, stages, **fields) -> VisionTransformer:
    torch.manual_seed(0)
    size = 2 * 4 * 2 ** max(len(stages) - 1, 0)  # a 2x2 grid of 1x1 patches behind the stem
    dims = dict(image_size=size, patch_size=1, width=32, depth=1, num_heads=4, mlp_dim=64, num_classes=3)
    config = ViTConfig(**dims, hybrid_stages=stages, hybrid_width=width_factor, **fields)
    return _randomize(VisionTransformer(config)).eval()  # no zero-init GN scale or head hides a misplaced array


@pytest.mark.parametrize(
    ("width_factor", "stages"),
    [(0.5, (1,)), (0.5, (1, 1, 1, 1)), (1, (2, 1)), (1.5, (1, 1, 1)), (2, (1, 1)), (2, ()), (0.5, ())],
)
def test_our_hybrid_saved_in_the_official_layout_loads_back_identically(tmp_path, width_factor, stages):
    model = _random_hybrid(width_factor, stages, representation_size=16)
    loaded = load_npz(_write(tmp_path / "ours.npz", arrays_from_model(model)))
    assert loaded.config == model.config  # hybrid_width 0.5 comes back 0.5, not 0 or 1
    images = torch.rand(2, 3, model.config.image_size, model.config.image_size) * 2 - 1
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))
    save_pretrained(loaded, tmp_path / "folder")  # and through model.json, where the factor is a JSON number
    assert json.loads((tmp_path / "folder" / "model.json").read_text())["hybrid_width"] == width_factor
    again = load_pretrained(tmp_path / "folder")
    assert again.config == model.config
    with torch.no_grad():
        assert torch.equal(again(images), model(images))


@pytest.mark.parametrize("width_factor", [0.25, 0.75, 1.25])
def test_widths_the_official_code_refuses_are_clear_errors(tmp_path, width_factor):
    # int(64 * f) = 16, 48, 80 channels: no 32-group GroupNorm divides them, in Flax as in torch.
    channels = int(64 * width_factor)
    path = _write(tmp_path / "odd.npz", official_arrays(stages=(1, 1), width_factor=width_factor, patch=1, grid=2))
    in_file = (
        rf"odd.npz is not a valid ViT checkpoint: conv_root/kernel has {channels} output channels .* cannot divide"
    )
    with pytest.raises(ValueError, match=in_file):
        load_npz(path)
    in_config = rf"hybrid_width={width_factor} gives a ResNet root of int\(64 \* {width_factor}\) = {channels} channels"
    with pytest.raises(ValueError, match=in_config):
        ViTConfig(image_size=32, patch_size=1, hybrid_stages=(1, 1), hybrid_width=width_factor)


def test_inconsistent_hybrid_arrays_are_clear_errors(tmp_path):
    arrays = official_arrays(stages=(1, 1), width_factor=0.5, patch=1, grid=2)
    wider = official_arrays(stages=(1, 1), width_factor=1, patch=1, grid=2)
    mixed = {**arrays, "conv_root/kernel": wider["conv_root/kernel"], "gn_root/scale": wider["gn_root/scale"]}
    expected = r"reads 256 channels but a ResNet stem with stages \(1, 1\) and a 64-channel root .* produces 512"
    with pytest.raises(ValueError, match=expected):
        load_npz(_write(tmp_path / "mixed.npz", mixed))
    del arrays["block2/unit1/conv2/kernel"]
    with pytest.raises(
        ValueError, match=r"do not fit .*: missing \['patch_embed.backbone.stages.block2.units.unit1.conv2"
    ):
        load_npz(_write(tmp_path / "incomplete.npz", arrays))


def test_big_vision_scan_layout_is_unstacked(tmp_path):
    arrays = official_arrays(layout="bv")
    stacked = {k: v for k, v in arrays.items() if "encoderblock_" not in k}
    for name in {k.split("/", 2)[2] for k in arrays if k.startswith("Transformer/encoderblock_0/")}:
        stacked[f"Transformer/encoderblock/{name}"] = np.stack(
            [arrays[f"Transformer/encoderblock_{i}/{name}"] for i in (0, 1)]
        )
    model = load_npz(_write(tmp_path / "scan.npz", stacked, "params/"))
    images = np.random.default_rng(2).uniform(-1, 1, (1, 16, 16, 3)).astype(np.float32)
    assert _relative_error(_logits(model, images), reference_logits(arrays, images, layout="bv")) <= 1e-5


def test_big_vision_pre_2022_posemb_inside_the_encoder(tmp_path):
    arrays = official_arrays(layout="vt")
    moved = dict(arrays)
    moved["Transformer/pos_embedding"] = moved.pop("Transformer/posembed_input/pos_embedding")
    model = load_npz(_write(tmp_path / "old_bv.npz", moved))
    images = np.random.default_rng(3).uniform(-1, 1, (1, 16, 16, 3)).astype(np.float32)
    assert _relative_error(_logits(model, images), reference_logits(arrays, images, layout="vt")) <= 1e-5


@pytest.mark.parametrize(("old", "new"), [(7, 12), (14, 24), (24, 14), (4, 5)])
def test_resize_pos_embed_equals_scipy_zoom_order_1(old, new):
    posemb = torch.randn(1, 1 + old * old, 8)
    resized = resize_pos_embed(posemb, (new, new))
    grid = posemb[0, 1:].reshape(old, old, 8).double().numpy()
    expected = scipy.ndimage.zoom(grid, (new / old, new / old, 1), order=1).reshape(1, new * new, 8)
    assert torch.equal(resized[:, :1], posemb[:, :1])  # the class row is kept
    np.testing.assert_allclose(resized[:, 1:].double().numpy(), expected, rtol=1e-5, atol=1e-6)
    gap = resize_pos_embed(posemb[:, 1:], (new, new), num_prefix_tokens=0)
    torch.testing.assert_close(gap, resized[:, 1:])


def test_load_npz_at_another_resolution_resizes_and_runs(tmp_path):
    arrays = official_arrays(grid=4)
    model = load_npz(_write(tmp_path / "ckpt.npz", arrays), image_size=28)
    assert model.config.image_size == 28 and model.pos_embed.shape == (1, 1 + 49, 32)
    grid = arrays["Transformer/posembed_input/pos_embedding"][0, 1:].reshape(4, 4, 32).astype(np.float64)
    expected = scipy.ndimage.zoom(grid, (7 / 4, 7 / 4, 1), order=1).reshape(49, 32)
    np.testing.assert_allclose(model.pos_embed[0, 1:].detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    assert model(torch.zeros(1, 3, 28, 28)).shape == (1, 5)


def test_head_overrides_follow_the_fine_tuning_protocol(tmp_path):
    path = _write(tmp_path / "i21k.npz", official_arrays(representation_size=24, num_classes=11))
    dropped = load_npz(path, num_classes=3, representation_size=None, dropout=0.1)
    assert dropped.config.representation_size is None and dropped.config.dropout == 0.1
    assert dropped.head.weight.shape == (3, 32) and torch.count_nonzero(dropped.head.weight) == 0
    kept = load_npz(path, num_classes=3)  # pre-logits kept with its trained weights, head reset
    assert kept.config.representation_size == 24 and torch.count_nonzero(kept.pre_logits[0].weight) > 0
    assert torch.count_nonzero(kept.head.weight) == 0
    with pytest.raises(ValueError, match="width=48 contradicts the weights"):
        load_npz(path, width=48)


def test_bad_files_are_clear_errors(tmp_path):
    good = _write(tmp_path / "good.npz", official_arrays())
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated or not an .npz archive"):
        load_npz(truncated)

    disguised = tmp_path / "weights.npz"
    disguised.write_bytes(pickle.dumps({"embedding/kernel": np.zeros((4, 4, 3, 8))}))
    with pytest.raises(ValueError, match="is a pickle, not an .npz archive; pickled data is never loaded"):
        load_npz(disguised)
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ValueError, match="neither a zip archive nor a NumPy file"):
        load_npz(tmp_path / "text.npz")

    object_array = tmp_path / "object.npz"
    np.savez(object_array, cls=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="pickled data"):
        load_npz(object_array)

    with pytest.raises(ValueError, match="not a ViT checkpoint: no 'embedding/kernel'.*conv1/kernel"):
        load_npz(_write(tmp_path / "resnet.npz", {"conv1/kernel": np.zeros((3, 3, 3, 8))}))

    incomplete = official_arrays()
    del incomplete["Transformer/encoderblock_1/MlpBlock_3/Dense_1/kernel"]
    with pytest.raises(ValueError, match="missing array 'mlp/Dense_1/kernel'"):
        load_npz(_write(tmp_path / "incomplete.npz", incomplete))

    np.save(tmp_path / "single.npy", np.zeros(3))
    (tmp_path / "single.npz").write_bytes((tmp_path / "single.npy").read_bytes())
    with pytest.raises(ValueError, match="single .npy array"):
        load_npz(tmp_path / "single.npz")
    with pytest.raises(FileNotFoundError):
        load_npz(tmp_path / "absent.npz")
    assert zipfile.is_zipfile(good)  # the good file itself was fine


def test_safetensors_round_trip_is_exact(tmp_path):
    for model in (
        build_model("vit_tiny_debug", representation_size=16),
        build_model("r26_vit_s32", depth=1, image_size=64),
    ):
        save_pretrained(model, tmp_path / "m")
        loaded = load_pretrained(tmp_path / "m")
        assert loaded.config == model.config
        original, restored = model.state_dict(), loaded.state_dict()
        assert original.keys() == restored.keys()
        for key in original:
            assert torch.equal(original[key], restored[key]), key


def test_loading_weights_skips_the_initialization_and_torch_dynamo(tmp_path):
    """A loaded model is built on the meta device and takes every value from the file: it is not initialized (on
    meta tensors torch's `normal_` imports torch._dynamo, 1.5 s of every eval task and CLI that loads weights), and
    the global generator is where it was."""
    save_pretrained(build_model("vit_tiny_debug", representation_size=16), tmp_path / "m")
    code = (
        "import sys, torch\n"
        "from pretrain.weights.formats import load_pretrained\n"
        "torch.manual_seed(0); expected = torch.rand(3)\n"
        "torch.manual_seed(0); load_pretrained(sys.argv[1]); drawn = torch.rand(3)\n"
        "print('torch._dynamo' in sys.modules, torch.equal(expected, drawn))\n"
    )
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]


def test_bf16_weights_load_as_fp32(tmp_path):
    model = build_model("vit_tiny_debug").to(torch.bfloat16)
    save_pretrained(model, tmp_path / "bf16")
    loaded = load_pretrained(tmp_path / "bf16")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert torch.equal(loaded.pos_embed, model.pos_embed.float())


def test_load_pretrained_resizes_for_another_resolution(tmp_path):
    model = build_model("vit_tiny_debug")
    save_pretrained(model, tmp_path / "m")
    bigger = load_pretrained(tmp_path / "m", image_size=48)
    expected = resize_pos_embed(model.pos_embed.detach(), (12, 12))
    assert bigger.config.image_size == 48 and torch.equal(bigger.pos_embed.detach(), expected)


def test_checkpoint_folder_needs_complete_marker(tmp_path):
    model = build_model("vit_tiny_debug")
    run = tmp_path / "run"
    for step in (100, 200, 300):
        save_pretrained(model, run / "checkpoints" / f"step_{step:08d}")
    for step in (100, 200):
        (run / "checkpoints" / f"step_{step:08d}" / "COMPLETE").write_text("")
    with pytest.raises(
        IncompleteCheckpointError, match=r"step_00000300 has no COMPLETE marker.* newest .*step_00000200"
    ):
        load_checkpoint_model(run / "checkpoints" / "step_00000300")
    assert latest_checkpoint(run) == run / "checkpoints" / "step_00000200"
    loaded = load_checkpoint_model(run / "checkpoints" / "step_00000200")
    assert torch.equal(loaded.pos_embed, model.pos_embed)
    assert isinstance(load_model(run / "checkpoints" / "step_00000100"), type(model))
    assert latest_checkpoint(tmp_path / "empty") is None


def test_convert_cli_writes_loadable_weights(tmp_path, capsys):
    arrays = official_arrays()
    main(["convert", str(_write(tmp_path / "ckpt.npz", arrays)), str(tmp_path / "out"), "--image-size", "24"])
    assert "wrote" in capsys.readouterr().out
    main(["info", str(tmp_path / "out")])
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["image_size"] == 24 and info["params_m"] > 0 and info["forward_gmacs"] > 0
    converted = load_pretrained(tmp_path / "out")
    direct = load_npz(tmp_path / "ckpt.npz", image_size=24)
    assert converted.config == direct.config
    for key, value in direct.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value)


def test_convert_never_writes_over_a_folder_it_did_not_write(tmp_path, capsys):
    npz = _write(tmp_path / "ckpt.npz", official_arrays())
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    save_pretrained(build_model("vit_tiny_debug"), checkpoint)
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "COMPLETE").write_text("")
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    cases = {checkpoint: r"step_00000002 holds COMPLETE, ", tmp_path: r"holds ckpt.npz, "}  # tmp_path: IN's folder
    for out_dir, expected in cases.items():
        assert main(["convert", str(npz), str(out_dir)]) == 2
        out, err = capsys.readouterr()
        assert not out and err.count("\n") == 1 and re.search(expected + ".*pass a new or empty folder", err), err
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    for _ in range(2):  # its own folder is written again
        assert main(["convert", str(npz), str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out and load_pretrained(tmp_path / "out").config.num_classes > 0


# --------------------------------------------------------------------------------------------- Hugging Face


def _randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05 if p.ndim > 1 else 0.2)
    return model


@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_hf_parity_ours_to_hf(gelu):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _randomize(build_model("vit_tiny_debug", num_classes=10, gelu_approximate=gelu)).eval()
    hf = transformers.ViTForImageClassification(hf_config(model.config)).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    images = torch.rand(3, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        ours, theirs = model(images), hf(pixel_values=images).logits
    assert (ours - theirs).abs().max() / theirs.abs().max() <= 1e-5


def test_hf_parity_hf_to_ours_both_layouts():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=96,
        image_size=24,
        patch_size=6,
        num_labels=4,
        layer_norm_eps=1e-6,
        hidden_act="gelu",
    )
    hf = _randomize(transformers.ViTForImageClassification(config)).eval()
    model = from_hf_state_dict(hf.state_dict(), config).eval()
    assert model.config.gelu_approximate == "none"
    images = torch.rand(2, 3, 24, 24) * 2 - 1
    with torch.no_grad():
        theirs = hf(pixel_values=images).logits
        assert (model(images) - theirs).abs().max() / theirs.abs().max() <= 1e-5
        hub = to_hf_state_dict(model, layout="hub")
        assert "vit.encoder.layer.1.attention.attention.query.weight" in hub
        again = from_hf_state_dict(hub, model.config).eval()
        assert torch.equal(again(images), model(images))


def test_an_hf_folder_keeps_its_layer_norm_eps(tmp_path, capsys):
    """HF's ViT defaults to LayerNorm eps 1e-12 (so do the Hub's ViT configs); every HF folder was read at Flax's
    1e-6, its logits off by ~1e-5 relative where activations are large, and exported again as 1e-6."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=24)
    config = transformers.ViTConfig(**shape, patch_size=6, num_labels=4, hidden_act="gelu_pytorch_tanh")
    assert config.layer_norm_eps == 1e-12  # left at HF's default, as in a folder from the Hub
    hf = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3 if p.ndim > 1 else 1)  # activations of a trained model's size, where eps shows
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    assert model.config.layer_norm_eps == 1e-12
    images = torch.rand(4, 3, 24, 24) * 2 - 1
    with torch.no_grad():
        theirs = hf(pixel_values=images).logits
        assert (model(images) - theirs).abs().max() / theirs.abs().max() <= 1e-6
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "config.json").read_text())["layer_norm_eps"] == 1e-12
    capsys.readouterr()
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "flax.npz"), "--format", "npz"]) == 2
    assert "layer_norm_eps=1e-12 (an HF folder's) cannot be expressed in the official .npz" in capsys.readouterr().err
    assert not (tmp_path / "flax.npz").exists()


def test_hf_export_refuses_what_hf_cannot_express():
    with pytest.raises(ValueError, match="pool='gap'"):
        to_hf_state_dict(build_model("vit_tiny_debug", pool="gap"))
    with pytest.raises(ValueError, match="pre-logits layer"):
        to_hf_state_dict(build_model("vit_tiny_debug", representation_size=8))


# --------------------------------------------------------------------------------------------- CLI on bad input


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name → (argv of `python -m pretrain.weights`, what its one error line must say)."""
    good = _write(tmp / "good.npz", official_arrays())
    (tmp / "pickle.npz").write_bytes(pickle.dumps({"embedding/kernel": np.zeros((4, 4, 3, 8))}))
    (tmp / "truncated.npz").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp / "empty.npz").write_bytes(b"")
    (tmp / "text.npz").write_text("hello")
    (tmp / "no_weights").mkdir()
    _write(tmp / "resnet.npz", {"conv1/kernel": np.zeros((3, 3, 3, 8), np.float32)})
    with zipfile.ZipFile(tmp / "plain.zip", "w") as z:
        z.writestr("notes.txt", "not an array")
    np.savez(tmp / "object.npz", cls=np.array([{"a": 1}], dtype=object))
    np.savez(tmp / "strings.npz", **{**official_arrays(), "cls": np.array(["a", "b"])})
    np.save(tmp / "single.npy", np.zeros(3))
    (tmp / "single.npz").write_bytes((tmp / "single.npy").read_bytes())
    _write(tmp / "wf075.npz", official_arrays(stages=(1,), width_factor=0.75, patch=1, grid=2))
    incomplete = official_arrays()
    del incomplete["Transformer/encoder_norm/scale"]
    _write(tmp / "incomplete.npz", incomplete)
    tiny = build_model("vit_tiny_debug")
    save_pretrained(tiny, tmp / "saved")
    mistyped = {"float_pre_logits": {"representation_size": 24.0}, "bool_classes": {"num_classes": True}}
    mistyped["text_bias"] = {"head_bias_init": "x"}
    for name in ("bad_header", "bad_json", "json_list", "bad_width", "no_config", "wrong_model", *mistyped):
        save_pretrained(tiny, tmp / name)
    for name, field in mistyped.items():  # a hand-edited model.json: tracebacks from nn.Linear / nn.init before
        (tmp / name / "model.json").write_text(json.dumps({**tiny.config.to_dict(), **field}))
    (tmp / "bad_header" / "model.safetensors").write_bytes(b"\xff" * 8 + b"{not a header")
    (tmp / "bare.safetensors").write_bytes((tmp / "saved" / "model.safetensors").read_bytes())
    (tmp / "bad_json" / "model.json").write_text("{'width': 64,")
    (tmp / "json_list" / "model.json").write_text("[1, 2]")
    hybrid = {**tiny.config.to_dict(), "hybrid_stages": [1], "hybrid_width": 0.75, "patch_size": 1}
    (tmp / "bad_width" / "model.json").write_text(json.dumps(hybrid))
    (tmp / "no_config" / "model.json").unlink()
    (tmp / "wrong_model" / "model.json").write_text(json.dumps({**tiny.config.to_dict(), "depth": 5}))
    (tmp / "unfinished").mkdir()
    (tmp / "unfinished" / "trainer_state.json").write_text("{}")
    save_pretrained(tiny, tmp / "run" / "checkpoints" / "step_00000002")
    (tmp / "run" / "checkpoints" / "step_00000002" / "COMPLETE").write_text("")
    (tmp / "empty_run" / "checkpoints" / "step_00000004").mkdir(parents=True)  # its first save never finished
    (tmp / "a_file").write_text("x")
    hf_config = json.loads((save_hf(tiny, tmp / "hf_labels") / "config.json").read_text())  # 3 names, not 1000:
    hf_config["id2label"] = {str(i): f"c{i}" for i in range(3)}  # "size mismatch for head.weight" on three lines
    (tmp / "hf_labels" / "config.json").write_text(json.dumps(hf_config))
    info = lambda name: ["info", str(tmp / name)]  # noqa: E731
    return {
        "pickle": (info("pickle.npz"), r"pickle.npz is a pickle, not an .npz archive; pickled data is never loaded"),
        "truncated": (info("truncated.npz"), r"truncated.npz is truncated or not an .npz archive.*download it again"),
        "missing": (info("absent.npz"), r"no file or folder at \S*absent.npz"),
        "missing_convert": (["convert", str(tmp / "absent.npz"), str(tmp / "o")], r"no checkpoint file at \S*absent"),
        "empty": (info("empty.npz"), r"empty.npz is empty \(0 bytes\)"),
        "text": (info("text.npz"), r"text.npz is neither a zip archive nor a NumPy file"),
        "folder_without_weights": (info("no_weights"), r"no_weights holds no weights .* pass an official .npz"),
        "convert_a_folder": (["convert", str(tmp / "saved"), str(tmp / "o")], r"saved is a folder, not an .npz file"),
        "npz_not_a_vit": (info("resnet.npz"), r"resnet.npz is not a ViT checkpoint: no 'embedding/kernel'.*conv1"),
        "zip_not_npz": (info("plain.zip"), r"plain.zip is a zip archive but not an .npz checkpoint.*'notes.txt'"),
        "object_array": (info("object.npz"), r"object.npz contains pickled data"),
        "string_array": (info("strings.npz"), r"strings.npz: array 'cls' has dtype <U1, not numbers"),
        "single_npy": (info("single.npz"), r"single.npz is a single .npy array"),
        "fractional_width_refused": (info("wf075.npz"), r"wf075.npz .*conv_root/kernel has 48 output channels"),
        "incomplete": (info("incomplete.npz"), r"incomplete.npz is not a complete ViT .*'Transformer/encoder_norm/s"),
        "safetensors_bad_header": (info("bad_header"), r"model.safetensors is not a readable safetensors file"),
        "safetensors_file_bad_header": (info("bad_header/model.safetensors"), r"not a readable safetensors file"),
        "bare_safetensors": (info("bare.safetensors"), r"bare.safetensors is a bare safetensors file.*model.json"),
        "config_not_json": (info("bad_json"), r"bad_json/model.json is not a valid model config"),
        "config_a_list": (info("json_list"), r"json_list/model.json .* it holds a JSON list"),
        "config_bad_width": (info("bad_width"), r"bad_width/model.json .*hybrid_width=0.75 gives .* 48 channels"),
        "no_config": (info("no_config"), r"no_config has no model.json"),
        "config_float_pre_logits": (info("float_pre_logits"), r"representation_size must be an int >= 1.* got 24.0"),
        "config_bool_classes": (info("bool_classes"), r"num_classes must be an int >= 0 \(0 = no head\), got True"),
        "config_text_bias": (info("text_bias"), r"head_bias_init must be a finite number, got 'x'"),
        "weights_of_another_model": (
            info("wrong_model"),
            r"wrong_model do not fit the model their config describes: missing \['blocks.4.*and \d+ more",
        ),
        "checkpoint_without_complete": (info("unfinished"), r"unfinished has no COMPLETE marker"),
        "hf_labels_not_the_head": (info("hf_labels"), r"config.json gives 3 classes .* has \d+; make its id2label"),
        "run_without_checkpoint": (info("empty_run"), r"empty_run is a run folder without a COMPLETE checkpoint"),
        "image_size_off_stride": (info("good.npz") + ["--image-size", "30"], r"image_size=30: .*patch stride 4"),
        "image_size_zero": (info("good.npz") + ["--image-size", "0"], r"--image-size must be a positive"),
        "image_size_not_a_number": (info("good.npz") + ["--image-size", "big"], r"invalid int value: 'big'"),
        "out_dir_is_a_file": (["convert", str(good), str(tmp / "a_file")], r"a_file is a file; pass a folder"),
        "unknown_command": (["show", str(good)], r"invalid choice: 'show'"),
    }


def test_cli_bad_input_exits_2_with_one_message_and_no_traceback(tmp_path, capsys):
    cases = _bad_inputs(tmp_path)
    assert len(cases) >= 30
    for name, (argv, expected) in cases.items():
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's own errors (flags, values)
            status = e.code
        out, err = capsys.readouterr()
        assert status == 2, f"{name}: exit status {status}\n{err}"
        assert "Traceback" not in err and not out, f"{name}: {out}{err}"
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith("python -m pretrain.weights"), f"{name}: {err}"
        assert re.search(expected, errors[0]), f"{name}: {errors[0]!r} does not match {expected!r}"
    assert main(["info", str(tmp_path / "saved" / "model.safetensors")]) == 0  # a weights folder's file: its folder
    assert json.loads(capsys.readouterr().out)["config"]["width"] == 64
    for run in ("run", "run/checkpoints"):  # a run folder: its newest COMPLETE checkpoint, as export and evals read it
        assert main(["info", str(tmp_path / run)]) == 0
        assert json.loads(capsys.readouterr().out)["config"]["width"] == 64
    # A file:// URL, as data folders take it ("no file or folder at file:/..." before).
    assert main(["info", f"file://{tmp_path / 'run'}"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["width"] == 64


def test_the_clis_own_checks_print_one_line_without_a_usage_line(tmp_path, capsys):
    cases = {name: argv for name, (argv, _) in _bad_inputs(tmp_path).items()}
    del cases["image_size_not_a_number"], cases["unknown_command"]  # argparse's own usage errors
    save_pretrained(build_model("vit_tiny_debug"), tmp_path / "ours")
    export = ["export", str(tmp_path / "ours")]
    cases |= {
        "hf_out_is_a_file": export + [str(tmp_path / "a_file")],
        "mlflow_with_npz": export + [str(tmp_path / "o.npz"), "--format", "npz", "--mlflow-run", "abc"],
        "out_in_a_bucket": export + ["gs://bucket/hf"],
        "export_image_size_zero": export + [str(tmp_path / "hf"), "--image-size", "0"],
    }
    for name, argv in cases.items():
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
        out, err = capsys.readouterr()
        assert status == 2 and not out and err.count("\n") == 1, f"{name}: {err}"
        assert err.startswith("python -m pretrain.weights: error: "), f"{name}: {err}"


def test_python_m_entry_point_exits_2_without_traceback(tmp_path):
    (tmp_path / "weights.npz").write_bytes(pickle.dumps([1, 2, 3]))
    root = Path(__file__).resolve().parents[2]
    target = tmp_path / "weights.npz"
    cmd = [sys.executable, "-m", "pretrain.weights", "info", str(target)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not proc.stdout, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"{target} is a pickle" in proc.stderr, proc.stderr
