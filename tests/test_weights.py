"""pretrain.weights: official npz import against an independent NumPy forward, resize, safetensors, HF parity."""

from __future__ import annotations

import json
import pickle
import zipfile

import numpy as np
import pytest
import scipy.ndimage
import torch
from weights_npz_reference import official_arrays, reference_logits

from pretrain.model import build_model
from pretrain.weights import (
    IncompleteCheckpointError,
    from_hf_state_dict,
    hf_config,
    latest_complete_checkpoint,
    load_checkpoint_model,
    load_model,
    load_npz,
    load_pretrained,
    main,
    resize_pos_embed,
    save_pretrained,
    to_hf_state_dict,
)

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
    with pytest.raises(IncompleteCheckpointError, match="no COMPLETE marker"):
        load_checkpoint_model(run / "checkpoints" / "step_00000300")
    assert latest_complete_checkpoint(run) == run / "checkpoints" / "step_00000200"
    loaded = load_checkpoint_model(run / "checkpoints" / "step_00000200")
    assert torch.equal(loaded.pos_embed, model.pos_embed)
    assert isinstance(load_model(run / "checkpoints" / "step_00000100"), type(model))
    assert latest_complete_checkpoint(tmp_path / "empty") is None


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
        hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=24,
        patch_size=6, num_labels=4, layer_norm_eps=1e-6, hidden_act="gelu",
    )  # fmt: skip
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


def test_hf_export_refuses_what_hf_cannot_express():
    with pytest.raises(ValueError, match="pool='gap'"):
        to_hf_state_dict(build_model("vit_tiny_debug", pool="gap"))
    with pytest.raises(ValueError, match="pre-logits layer"):
        to_hf_state_dict(build_model("vit_tiny_debug", representation_size=8))
