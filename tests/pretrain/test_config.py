"""pretrain.config.train_config: recipes load and validate; bad configs fail before any work, naming the field and the
fix."""

import dataclasses
import shutil
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from pretrain.config.ds_config import batch_plan, deepspeed_config
from pretrain.config.optim import build_schedule
from pretrain.config.train_config import RECIPE_DIR, TrainConfig, load_config
from pretrain.config.typed_yaml import build, parse_override, read_mapping
from pretrain.model.tasks import LOSSES, LossType

RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def _world(recipe: str) -> int:
    """Cluster recipes are sized for 64 GPUs (their data lives on the cluster); local_* ones run here on 2 workers."""
    return 2 if recipe.startswith("local_") else 64


def test_the_issue_recipes_ship():
    required = {"local_demo", "vit_b16_i21k", "vit_l16_i21k", "vit_h14_i21k", "r50_vit_b16_i21k", "vit_b16_i21k_augreg"}
    assert required <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_validates(recipe):
    config = load_config(recipe)
    world = _world(recipe)
    # Paths are checked for the local recipes (their data is generated on demand); cluster data is not here.
    config.validate(world, check_paths=recipe.startswith("local_"))
    plan = batch_plan(config.data, world)
    assert plan.micro_batch_size * plan.grad_accum_steps * world == config.data.global_batch_size
    schedule = build_schedule(
        config.optim, config.schedule, config.data.global_batch_size, config.data.epoch_images or 3840
    )
    assert 0 <= schedule.warmup_steps < schedule.total_steps
    header = (RECIPE_DIR / f"{recipe}.yaml").read_text().splitlines()[:12]
    text = "\n".join(header).lower()
    assert "command:" in text and "hardware:" in text and "expected:" in text, f"{recipe}: header must say all three"


def test_i21k_recipes_follow_the_paper():
    for name in ("vit_b16_i21k", "vit_l16_i21k", "vit_h14_i21k", "r50_vit_b16_i21k"):
        c = load_config(name)
        assert (c.optim.beta1, c.optim.beta2, c.optim.lr, c.optim.grad_clip) == (0.9, 0.999, 1e-3, 1.0)
        assert 0.03 <= c.optim.weight_decay <= 0.1
        assert c.data.global_batch_size == 4096 and c.model.dropout == 0.1
        assert c.loss.type == "sigmoid_xent" and c.model.head_bias_init == -10.0
        assert c.schedule.warmup == 10_000 and c.schedule.decay == "linear" and c.schedule.end_lr == 1e-5
        assert c.schedule.total == "90ep" and c.data.epoch_images == 12_400_000
    assert load_config("vit_b16_i21k").model.representation_size == 768
    augreg = load_config("vit_b16_i21k_augreg")
    assert augreg.schedule.decay == "cosine" and augreg.data.mixup_alpha == 0.2
    assert (augreg.data.augment.randaugment_n, augreg.data.augment.randaugment_m) == (2, 10)


def test_overrides_are_dotted_and_typed():
    config = load_config(
        "local_demo", ["model.name=vit_s16", "optim.lr=3e-4", "schedule.total=2ep", "data.augment=null"]
    )
    assert config.model.name == "vit_s16" and config.optim.lr == pytest.approx(3e-4)
    assert config.schedule.total == "2ep" and config.data.augment is None
    assert parse_override("deepspeed.zero_stage=3") == (["deepspeed", "zero_stage"], 3)
    with pytest.raises(ValueError, match="key=value"):
        parse_override("optim.lr")
    with pytest.raises(ValueError, match=r"optim\.lrr.*valid keys"):
        load_config("local_demo", ["optim.lrr=1"])
    with pytest.raises(ValueError, match="deepspeed.zero_stage must be an integer"):
        load_config("local_demo", ["deepspeed.zero_stage=two"])


def test_round_trip_through_dict_and_yaml(tmp_path):
    config = load_config("vit_b16_i21k_augreg")
    assert TrainConfig.from_dict(config.to_dict()) == config
    config.save(tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


BAD = [
    (["model.name=vit_giant"], r"model\.name='vit_giant' is unknown; set model\.name to one of"),
    (["data.micro_batch_size=24"], r"data\.global_batch_size=64 is not divisible .*valid data\.micro_batch_size"),
    (["optim.lr=-0.001"], r"optim\.lr=-0\.001 must be > 0"),
    (["deepspeed.zero_stage=4"], r"deepspeed\.zero_stage=4 is not a ZeRO stage; use 0, 1, 2 or 3"),
    (["deepspeed.precision=fp16"], r"deepspeed\.precision='fp16'.*use bf16"),
    (["loss.type=hinge"], r"loss\.type='hinge' is unknown"),
    (["loss.type=sigmoid_xent", "loss.label_smoothing=0.1"], r"label_smoothing applies to softmax_xent only"),
    (["schedule.warmup=5000"], r"schedule\.warmup \(5000 steps\) must be shorter than schedule\.total"),
    (["schedule.total=3ep", "data.epoch_images=null", "data.train=s3://bucket/x"], r"set data\.epoch_images"),
    (["task.name=jigsaw"], r"task\.name='jigsaw' is not registered"),
    (["task.name=mpp", "task.options={corrupt_fraction: 2}"], r"task\.options\.corrupt_fraction must be in \(0, 1\]"),
    (["task.options.corrupt_fraction=0"], r"task\.options\.corrupt_fraction must be in \(0, 1\]"),
    (["task.options.mpp_weight=0"], r"task\.options\.mpp_weight=0 must be a number > 0"),
    (["task.options.mask_ratio=0.5"], r"unknown keys \['mask_ratio'\] for task 'classification_mpp'; known: .*weight"),
    (["task.name=mpp"], r"unknown keys \['mpp_weight'\] for task 'mpp'"),
    (["data.builtin_options.background_ramp=257"], r"data\.builtin_options: background_ramp=257 is out of range"),
    (["data.builtin_options.class_offset=51"], r"data\.builtin_options: class_offset=51 is out of range"),
    (["checkpoint.every_steps=0"], r"checkpoint\.every_steps=0 must be > 0"),
    # passed `pretrain.train --dry-run`, refused by the run at its engine's build
    (
        ["deepspeed.precision=fp32", "deepspeed.communication_data_type=bf16"],
        r"deepspeed\.communication_data_type=bf16 with fp32 training rounds every gradient to bf16",
    ),
    # passed, then every rank's first step failed after the whole start: "error: expected non-negative integer"
    # from numpy's SeedSequence (`model_randomness`), naming no field
    (["seed=-1"], r"seed=-1 must be an integer in \[0, 2\*\*32\), e\.g\. seed=0"),
    (["seed=4294967301"], r"seed=4294967301 must be an integer in \[0, 2\*\*32\)"),
    (["checkpoint.dir="], r"checkpoint\.dir is empty; set it to the run folder"),
    (["schedule.decay=exponential"], r"schedule\.decay='exponential' is unknown; use one of linear, cosine"),
    (["schedule.total=90days"], r"schedule\.total='90days' is not a duration; write steps"),
    (["schedule.total=1.2.3ep"], r"schedule\.total='1\.2\.3ep' is not a duration; write steps"),
    (["schedule.total=1e400"], r"schedule\.total='1e400' is not a finite duration"),
    (["schedule.end_lr=1.0"], r"schedule\.end_lr=1\.0 must be in \[0, optim\.lr=0\.003\]"),
    (["optim.beta2=1.0"], r"optim\.beta2=1\.0 must be in \[0, 1\); the paper uses 0\.9 / 0\.999"),
    (["optim.lr=nan"], r"optim\.lr must be a finite number, got nan"),
    (["loss.type=softmax_xent", "loss.label_smoothing=1.0"], r"loss\.label_smoothing=1\.0 must be in \[0, 1\)"),
    # The ViT's own checks, named by the recipe key that set the field.
    (["model.dropout=1.0"], r"valid vit_tiny_debug: model\.dropout must be in \[0, 1\), got 1\.0"),
    (["model.representation_size=0"], r"model\.representation_size must be an int >= 1, or absent for no pre-logits"),
    (["model.representation_size=None"], r"model\.representation_size='None' is a string to YAML; write null"),
    (["model.num_classes=-1"], r"model\.num_classes=-1: pre-training needs a head of at least one class; set it to"),
    # 0 passed the dry run (checked as 1) and was refused by the run, after DeepSpeed's start.
    (["model.num_classes=0"], r"model\.num_classes=0: pre-training .* or null to take it from the dataset$"),
    (
        ["data.image_size=30"],
        r"valid vit_tiny_debug: data\.image_size=30 is not a multiple of the patch stride .*"
        r"use e\.g\. data\.image_size=32$",
    ),
    (["model=vit_b16"], r"model must be a mapping of keys, got 'vit_b16'; set its keys one by one \(model\.name, "),
    (["data.normalize_on=gpu"], r"data\.normalize_on='gpu' is unknown; use one of auto, loader, device"),
    (["data.num_workers=-1"], r"data\.num_workers=-1 must be >= 0"),
    # passed, then the stream's first shard order failed in numpy ("expected non-negative integer"), naming no field
    (["data.seed=-1"], r"data\.seed=-1 must be >= 0"),
    (["data.seed=4294967301"], r"data\.seed=4294967301 must be below 2\*\*32, e\.g\. data\.seed=0"),
    # passed, then every rank failed at its stream, after the engine's build, naming no field
    (["data.mixup_alpha=0.2", "data.streams=64"], r"data\.mixup_alpha=0\.2 mixes .* = 1; it needs >= 2: set data\.str"),
    (["data.builtin=imagenet"], r"data\.builtin='imagenet' is unknown; use one of fractal, rcdb, .* or unset it"),
    (["data.builtin_options.nope=1"], r"data\.builtin_options\.nope is unknown; valid options: resolution, seed"),
    (["data.builtin_options.background_ramp=x"], r"data\.builtin_options\.background_ramp='x' must be an integer >= 0"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[o[0] for o, _ in BAD])
def test_bad_configs_fail_naming_field_and_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("local_demo", overrides).validate(2)


def test_init_from_a_folder_of_another_architecture_is_refused_at_load(tmp_path):
    """Its model.json says so: refused where the recipe is checked (`make launch`, every start), not in each rank
    after the process group starts, where a Ray job's workers were restarted on it."""
    from pretrain.model.vit import build_model
    from pretrain.weights.formats import save_pretrained

    save_pretrained(build_model("vit_tiny_debug", num_classes=4), tmp_path / "w")
    config = load_config("local_demo", [f"checkpoint.init_from={tmp_path / 'w'}", "model.name=vit_s16"])
    with pytest.raises(
        ValueError, match=r"init_from=.*w: its weights are of another architecture .*patch_size 4, not 16"
    ):
        config.validate(2)
    load_config("local_demo", [f"checkpoint.init_from={tmp_path / 'w'}", "model.pool=gap"]).validate(2)  # a fine-tune


def test_missing_shards_fail_before_work(tmp_path):
    missing = tmp_path / "nowhere" / "train"
    config = load_config("local_demo", [f"data.train={missing}", "data.builtin=null"])
    with pytest.raises(
        ValueError, match=r"data\.train=.*no shard folder there \(no manifest\.parquet\).*data_pipeline\.builtin"
    ):
        config.validate(2)
    # A built-in name only helps when the path is where that dataset would be generated.
    config = load_config("local_demo", [f"data.train={missing}", "data.builtin=fractal", "data.builtin_options={}"])
    with pytest.raises(ValueError, match=r"no shard folder there .* cannot hold built-in dataset 'fractal'"):
        config.validate(2)
    load_config("local_demo", [f"data.train={tmp_path}/rcdb/train"]).validate(2)  # generated on demand: fine


def test_resume_and_init_paths_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint\.resume_from=.*no COMPLETE marker"):
        load_config("local_demo", [f"checkpoint.resume_from={tmp_path}"]).validate(2)
    with pytest.raises(ValueError, match=r"checkpoint\.init_from=.*neither an \.npz"):
        load_config("local_demo", [f"checkpoint.init_from={tmp_path}"]).validate(2)
    # Object storage: weights to start from are fetched (checked then); a run folder or a resume needs a filesystem.
    load_config("local_demo", ["checkpoint.init_from=gs://bucket/runs/r"]).validate(2)
    with pytest.raises(ValueError, match=r"checkpoint\.dir='s3://bucket/r' is object storage; .*filesystem path"):
        load_config("local_demo", ["checkpoint.dir=s3://bucket/r"]).validate(2)
    with pytest.raises(ValueError, match=r"checkpoint\.resume_from='gs://b/r/.*' is object storage; .*init_from"):
        load_config("local_demo", ["checkpoint.resume_from=gs://b/r/checkpoints/step_00000002"]).validate(2)
    # A run folder where a file is: the ranks' first save failed with a traceback.
    (tmp_path / "notes.txt").write_text("not a folder")
    for run in ("notes.txt", "notes.txt/run"):
        with pytest.raises(ValueError, match=rf"checkpoint\.dir='.*{run}': .*notes.txt is a file; set checkpoint"):
            load_config("local_demo", [f"checkpoint.dir={tmp_path / run}"]).validate(2)


def test_deepspeed_config_is_generated_from_one_batch_plan():
    config = load_config("vit_b16_i21k", ["data.micro_batch_size=32", "deepspeed.zero_stage=3"])
    plan = batch_plan(config.data, 8)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (32, 16)
    cpu = deepspeed_config(config.deepspeed, config.optim, plan, "fp32")
    gpu = deepspeed_config(config.deepspeed, config.optim, plan, "bf16")
    assert cpu["train_batch_size"] == 4096 == 32 * 16 * 8
    assert cpu["gradient_accumulation_steps"] == 16 and cpu["train_micro_batch_size_per_gpu"] == 32
    assert cpu["bf16"]["enabled"] is False and gpu["bf16"]["enabled"] is True
    assert cpu["gradient_clipping"] == 1.0 and cpu["zero_optimization"]["stage"] == 3
    assert cpu["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    assert cpu["data_types"]["grad_accum_dtype"] == "fp32"
    assert "optimizer" not in cpu and "scheduler" not in cpu  # ours: torch AdamW + lr computed per step


def test_recipe_lookup_errors_list_the_recipes(tmp_path):
    with pytest.raises(ValueError, match=r"no recipe 'nope'.*local_demo"):
        load_config("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="must be a YAML mapping"):
        load_config(Path(bad))


def test_closed_sets_are_literals_whose_errors_list_the_choices():
    with pytest.raises(ValueError, match=r"--set override: model\.pool='avg' is unknown; use one of token, gap"):
        load_config("local_demo", ["model.pool=avg"])
    with pytest.raises(ValueError, match=r"data\.loader_start_method='thread' is unknown; use one of fork, forkserver"):
        load_config("local_demo", ["data.loader_start_method=thread"])
    assert typing.get_args(LossType) == tuple(LOSSES)  # the Literal is the registry's keys
    # A config made in code, not from a recipe, passes the same checks.
    config = load_config("local_demo")
    bad = config.replace(deepspeed=dataclasses.replace(config.deepspeed, precision="fp16"))
    with pytest.raises(ValueError, match=r"deepspeed\.precision='fp16'.*use bf16"):
        bad.validate(2, check_paths=False)


def test_recipes_inherit_through_base_and_refuse_circles(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("base: local_mpp\ntask:\n  options:\n    color_bits: 2\n")
    config = load_config(child)
    assert config.recipe == "child" and config.task.name == "mpp"
    assert config.task.options == {"color_bits": 2}  # free-form options are replaced whole, not merged
    assert config.deepspeed == load_config("local_demo").deepspeed  # two levels up the chain
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"base: {loop}\n")
    with pytest.raises(ValueError, match=r"loop\.yaml inherits from itself via 'base:'"):
        load_config(loop)


@dataclass(frozen=True)
class _Inner:
    size: int
    mode: Literal["a", "b"] = "a"


@dataclass(frozen=True)
class _Outer:
    name: str
    inner: _Inner = field(default_factory=lambda: _Inner(1))
    shape: tuple[int, ...] = ()
    rate: float | None = None
    stage: Literal[0, 1, 2, 3] = 0


def test_typed_yaml_builds_any_dataclass_naming_the_source_and_key(tmp_path):
    """What recipes, cluster profiles and eval suites share: read a mapping, build a typed dataclass from it."""
    path = tmp_path / "s.yaml"
    path.write_text("name: x\ninner:\n  size: 3\n  mode: b\nshape: [1, 2]\nrate: 1e-3\n")
    built = build(_Outer, read_mapping(path, "suite", "see the docs"), "suite s")
    assert built == _Outer("x", _Inner(3, "b"), (1, 2), 1e-3)
    bad = [
        ({"inner": {"size": 1}}, r"^suite s: missing required key 'name'$"),
        ({"name": "x", "inner": {"size": 1, "mode": "c"}}, r"^suite s: inner\.mode='c' is unknown; use one of a, b$"),
        ({"name": "x", "inner": {"sise": 1}}, r"key\(s\) \['inner\.sise'\] in inner; valid keys: \['size', 'mode'\]"),
        ({"name": 3}, r"^suite s: name must be a string, got 3; quote it$"),
        ({"name": "x", "shape": [1, "two"]}, r"shape\[1\] must be an integer, got 'two'"),
        ({"name": "x", "rate": "fast"}, r"rate must be a number, got 'fast'"),
        (
            {"name": "x", "inner": [1]},
            r"inner must be a mapping of keys, got \[1\]; set its keys one by one \(inner\.size, ",
        ),
        # YAML's true is not 1, for an integer or a closed set of them (pydantic's lax mode takes it: docs/design.md)
        ({"name": "x", "inner": {"size": True}}, r"inner\.size must be an integer, got True"),
        ({"name": "x", "stage": True}, r"^suite s: stage=True is unknown; use one of 0, 1, 2, 3$"),
    ]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            build(_Outer, data, "suite s")
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match=r"suite .*s\.yaml must be a YAML mapping, got a list; see the docs"):
        read_mapping(path, "suite", "see the docs")
    # A key given twice: YAML keeps the last without a word (a recipe's second `total:` replaced the first).
    for text, message in (
        ("name: x\nshape: [1, 2\n", r"suite .*s\.yaml, line \d+, column \d+: invalid YAML"),
        ("name: x\nschedule:\n  total: 10\n  warmup: 2\n  total: 20\n", r"s\.yaml, line 5: key 'total' appears twice"),
        ("name: x\nschedule: {total: 10}\nname: y\n", r"line 3: key 'name' appears twice in one mapping"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_mapping(path, "suite", "see the docs")


def test_step0_baseline_eval_is_on_by_default_and_can_be_turned_off():
    assert load_config("local_demo").evals.baseline is True
    assert load_config("local_demo", ["evals.baseline=false"]).evals.baseline is False
    with pytest.raises(ValueError, match="evals.baseline must be true or false"):
        load_config("local_demo", ["evals.baseline=maybe"])


def test_model_compile_without_a_compiler_is_refused_before_any_work(monkeypatch):
    config = load_config("local_demo", ["model.compile=true"])
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ValueError, match=r"model\.compile=true needs a C\+\+ compiler.*set model\.compile=false"):
        config.validate(2)
    config.validate(2, check_paths=False)  # a recipe checked for another machine: its compiler is not here
    monkeypatch.delenv("CXX")
    if shutil.which("g++"):
        config.validate(2)


def test_init_from_a_transformers_folder_loads_and_its_architecture_is_checked_at_load(tmp_path):
    """An exported HF folder is a weights source like the others (docs/contracts.md, "Resume"): validation accepted
    it, and then every rank failed on its missing model.json."""
    import torch

    from pretrain.checkpointer import init_weights
    from pretrain.model.vit import build_model
    from pretrain.weights.export import save_hf

    torch.manual_seed(0)
    trained = build_model("vit_tiny_debug", num_classes=4).eval()
    for p in trained.parameters():
        p.data.normal_(std=0.1)
    save_hf(trained, tmp_path / "hf")
    config = load_config("local_demo", [f"checkpoint.init_from={tmp_path / 'hf'}", "model.name=vit_s16"])
    with pytest.raises(ValueError, match=r"init_from=.*hf: its weights are of another architecture .*patch_size 4"):
        config.validate(2)
    load_config("local_demo", [f"checkpoint.init_from={tmp_path / 'hf'}"]).validate(2)

    model = build_model("vit_tiny_debug", num_classes=4).eval()
    assert init_weights(model, tmp_path / "hf", 32) == []  # every tensor copied
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(images), trained(images), rtol=0, atol=0)
