"""cluster.plan.evals.cost + cluster.plan.evals.cadence: each suite's FLOPs, device-hours and memory by hand, the
shipped i21k plan under its budget, the refusals (over budget, an eval that does not fit, an eval on a training GPU, CPU
evals without memory), the cadence rule, the eval task's Ray memory and the merged suite of a checkpoint due for
several. The scheduler honouring the cadence with real Ray: tests/cluster/test_driver.py (`_check_cadence`)."""

from __future__ import annotations

import dataclasses
import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cluster.driver.eval_scheduler import MAX_PINNED, merged_suite, task_options
from cluster.plan import memory
from cluster.plan.errors import PlanError
from cluster.plan.evals import cost as evals_cost
from cluster.plan.evals.cadence import EvalCadence
from cluster.plan.evals.cost import EvalDevice, suite_cost
from cluster.plan.planner import build_plan, resolve_config
from cluster.plan.text import format_plan
from cluster.profiles import ClusterProfile, load_profile
from evals.inspection import run_inspection
from evals.suites import load_suite
from pretrain.config.train_config import CheckpointConfig, EvalsConfig, SuiteCadence, TrainConfig, load_config
from pretrain.model import flops
from pretrain.model.vit import VisionTransformer, ViTConfig, model_config
from pretrain.telemetry.peak import Peak
from tests.support.saved_bytes import saved_bytes_per_image

NO_PROBE = "evals.extra_suites=[]"  # vtab1k in place of the recipe's few-shot, without its vtab1k_probe beside it

SMALL_SUITE = """
name: small
evaluators:
  - type: fewshot
    datasets: [digits]
    shots: [1]
    batch_size: 16
  - type: finetune
    datasets: [digits]
    train_examples: 80
    val_examples: 20
    steps: 10
    batch_size: 8
    micro_batch_size: 4
    lr_grid: [0.1, 0.3]
    warmup_steps: 2
    eval_steps: [5, 10]
  - type: vtab
    benchmark: vtab1k
    protocol: finetune
    tasks: [dtd, kitti_dist]
    image_size: 64
    finetune:
      steps: 5
      batch_size: 4
      lr_grid: [0.01, 0.03]
      activation_checkpointing: true
"""


@pytest.mark.timeout(60)
def test_a_small_suite_is_priced_by_hand(tmp_path):
    """Built-in digits (1297 train, 500 test), and two VTAB-1k tasks (1000 train; 1880 and 711 test), on a GPU of
    10 TFLOP/s at 50% MFU: every count below is the module docstring's formula written out."""
    (tmp_path / "small.yaml").write_text(SMALL_SUITE)
    vit = model_config("vit_tiny_debug", image_size=32, num_classes=10)
    config = TrainConfig(evals=EvalsConfig(suite="small", data_root=str(tmp_path / "empty")))
    peaks = {"bf16": Peak(20.0, "test"), "fp32": Peak(10.0, "test")}
    device = EvalDevice("cuda", 24e9, 0.0, 0.5, "a test GPU", peaks)
    cost = suite_cost(str(tmp_path / "small.yaml"), vit, config, device)

    def fwd(size: int, classes: int) -> float:  # the features run no head (0 classes); a fine-tuned one its own
        return flops.forward_flops(dataclasses.replace(vit, image_size=size, num_classes=classes))

    fewshot = (1297 + 500) * fwd(32, 0)  # features once per split, fp32
    # finetune: 2 lr x 10 steps x 8 on the 80 kept + 10 final steps x 8 on 100, 3 forwards each; the 20 held out
    # scored per lr, test (500) at step 5 and at the end; a 10-class head (the split is not readable here).
    finetune = (2 * 10 * 8 + 10 * 8) * 3 * fwd(32, 10) + (2 * 20 + 2 * 500) * fwd(32, 10)
    # vtab: per task (2 lr + 1 final) x 5 steps x batch 4, 4 forwards with checkpointing; val200 per lr, test once;
    # dtd has 47 classes, kitti_dist 4.
    vtab = sum((3 * 5 * 4) * 4 * fwd(64, k) + (2 * 200 + test) * fwd(64, k) for k, test in ((47, 1880), (4, 711)))
    assert cost.pflops * 1e15 == pytest.approx(fewshot + finetune + vtab)
    # Fine-tuning runs under bf16 autocast (precision auto on cuda), the features in fp32.
    assert cost.device_hours == pytest.approx((fewshot / 10e12 + (finetune + vtab) / 20e12) / 0.5 / 3600)
    # Memory of the finetune entry at 32 px: fp32 weights, gradients, momentum + 4 images' activations x 1.3 + the
    # drawn batch of 8 as float32 + the CUDA context.
    per_image = memory.activation_bytes_per_image(
        tokens=vit.num_patches + 1,
        width=vit.width,
        mlp_dim=vit.mlp_dim,
        depth=vit.depth,
        num_heads=vit.num_heads,
        precision="bf16",
    )
    need = 12 * flops.param_count(vit) + 4 * 1.3 * per_image + 8 * 3 * 32 * 32 * 4 + 1.3e9
    finetune_entry = load_suite(tmp_path / "small.yaml").evaluators[1]
    work = evals_cost._entry_work(finetune_entry, vit, str(tmp_path / "empty"), "cuda")
    assert work.device_bytes + 1.3e9 == pytest.approx(need) and cost.memory_gb * 1e9 >= need
    assert "vtab finetune 2 tasks x (2 lr x 5 + 5 steps) x batch 4 at 64px" in cost.detail


@pytest.mark.timeout(120)
def test_the_h14_plan_prints_each_suite_under_budget():
    profile = load_profile("a100x64")
    plan = build_plan(profile, resolve_config(profile, "vit_h14_i21k", [], "h14-evals"))
    e = plan.evals
    assert [c.suite for c in e.suites] == ["i21k_fewshot", "vtab1k_probe"]
    assert [(c.every, c.evaluations) for c in e.suites] == [(2, 70), (20, 8)]  # 272461 steps, a checkpoint per 2000
    assert e.share == pytest.approx(sum(c.share for c in e.suites)) and e.share <= 0.10
    train = plan.compute.total_exaflops * 1e18
    for c in e.suites:
        assert c.share == pytest.approx(c.evaluations * c.pflops * 1e15 / train)
        assert c.memory_gb <= e.capacity_gb == 24
    text = format_plan(plan)
    for c in e.suites:
        line = next(x for x in text.splitlines() if x.startswith(f"    {c.suite}"))
        assert f"{c.device_hours:.3g} device-hours" in line and f"{100 * c.share:.3g}% of training" in line
        assert f"{c.pflops:.3g} PFLOPs" in line and "GB of 24 GB per device per checkpoint" in line
    assert "on 1 x A10G (24 GB) per eval on the g5.2xlarge node group" in text
    assert f"evals budget  {100 * e.share:.3g}% of the training FLOPs in all, within evals.budget_fraction 10%" in text
    # the few-shot suite (every 2nd checkpoint) and the probe keep up on one A10G, none skipped behind the probe
    assert not e.warnings


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cluster", ["a100x8", "h100x8"])
def test_b16_plans_on_cpu_eval_profiles_price_the_evals_on_their_cpus(cluster):
    profile = load_profile(cluster)
    plan = build_plan(profile, resolve_config(profile, "vit_b16_i21k", [], "b16-evals"))
    assert plan.evals.share <= 0.10 and "beside training, 32 GB reserved in Ray" in plan.evals.device
    assert all(c.memory_gb <= 32 for c in plan.evals.suites)
    # On 16 CPUs the evals fall behind and outlast the job's end (the recipe's comment); each warning's --set fixes it.
    pace, last = plan.evals.warnings
    assert "eval devices to keep up with training" in pace and "evals.timeout_s=7200 s" in last
    sets = [quoted or bare for quoted, bare in re.findall(r"--set (?:'([^']*)'|([^\s)']+))", pace + last)]
    assert [s.split("=")[0] for s in sets] == ["evals.every", "evals.extra_suites", "evals.timeout_s"]
    assert not build_plan(profile, resolve_config(profile, "vit_b16_i21k", sets, "b16-evals")).evals.warnings


@pytest.mark.timeout(120)
def test_evals_over_budget_are_refused_with_the_cadence_that_fits():
    profile = load_profile("a100x64")
    sets = ["evals.budget_fraction=0.0012"]  # the few-shot suite takes 0.05%, the probe at every 20th 0.10%
    with pytest.raises(PlanError, match=r"over evals.budget_fraction=0.0012 .*raise its every to (\d+)") as refused:
        build_plan(profile, resolve_config(profile, "vit_h14_i21k", sets, "h"))
    assert "change its protocol" in str(refused.value) and "evals.budget_fraction" in str(refused.value)
    every = re.search(r"raise its every to (\d+)", str(refused.value)).group(1)
    fixed = [*sets, f"evals.extra_suites=[{{suite: vtab1k_probe, every: {every}}}]"]
    assert build_plan(profile, resolve_config(profile, "vit_h14_i21k", fixed, "h")).evals.share <= 0.0012
    # The paper's VTAB-1k fine-tuning costs ~27% of B/16's training per evaluation: no cadence brings it in.
    with pytest.raises(PlanError, match=r"vtab1k .*evaluate it less often .*a linear probe or few-shot instead"):
        build_plan(profile, resolve_config(profile, "vit_b16_i21k", ["evals.suite=vtab1k", NO_PROBE], "b"))


@pytest.mark.timeout(120)
def test_an_eval_that_cannot_fit_its_device_is_refused_with_the_fix():
    a100x64 = load_profile("a100x64")
    # vtab1k's micro-batch 32 at 384 px suits B/16 on the A10G; L/16 needs ~26 GB there.
    with pytest.raises(PlanError, match=r"vtab1k, entry vtab: needs ~2\d\.\d GB .* over the 24 GB of GPU memory") as e:
        build_plan(a100x64, resolve_config(a100x64, "vit_l16_i21k", ["evals.suite=vtab1k", NO_PROBE], "l"))
    assert "micro_batch_size: 16 (a divisor of batch_size 512)" in str(e.value)
    assert "activation_checkpointing: true" in str(e.value) and "a bigger eval device" in str(e.value)
    # A resolution the model's patches do not divide would fail at the first checkpoint.
    with pytest.raises(PlanError, match=r"image_size=384 is not a multiple of the model's patch stride 14"):
        build_plan(a100x64, resolve_config(a100x64, "vit_h14_i21k", ["evals.suite=vtab1k", NO_PROBE], "h"))
    # CPU evals beside training: what they need against the memory they reserve in Ray.
    a100x8 = load_profile("a100x8")
    small = dataclasses.replace(a100x8, evals=dataclasses.replace(a100x8.evals, memory_gb=4))
    with pytest.raises(PlanError, match=r"i21k_fewshot, entry fewshot: needs ~\d+\.\d+ GB .* over the 4 GB of evals"):
        build_plan(small, resolve_config(small, "vit_h14_i21k", [], "h"))


def test_evals_never_take_a_training_gpu_and_cpu_evals_declare_their_memory():
    a100x64 = load_profile("a100x64")
    assert a100x64.evals.num_gpus == 1 and a100x64.evals.instance_type  # a node group of its own
    shared = dataclasses.replace(a100x64, evals=dataclasses.replace(a100x64.evals, instance_type=""))
    with pytest.raises(PlanError, match=r"would take a training GPU .*evals.instance_type"):
        evals_cost.eval_device(shared)
    for name in ("a100x8", "h100x8", "local", "local_elastic"):  # CPU evals on the training nodes
        profile = load_profile(name)
        assert profile.evals.num_gpus == 0 and profile.evals.memory_gb > 0
        bare = dataclasses.replace(profile, evals=dataclasses.replace(profile.evals, memory_gb=0))
        with pytest.raises(PlanError, match=r"declare no memory; set evals.memory_gb"):
            evals_cost.eval_device(bare)
    # The eval task asks Ray for that memory, in bytes; without a declaration it asks for none.
    assert task_options(12, 0, 32) == {"num_cpus": 12, "num_gpus": 0, "max_retries": 1, "memory": 32_000_000_000}
    assert "memory" not in task_options(1, 0, 0)


def test_the_cadence_evaluates_every_nth_checkpoint_the_baseline_and_the_last():
    c = EvalCadence((("fewshot", 1), ("vtab", 3)), checkpoint_every=100, last_step=1050)
    assert c.due(0) == ("fewshot", "vtab")  # the baseline
    assert c.due(100) == c.due(200) == ("fewshot",) and c.due(300) == ("fewshot", "vtab")
    assert c.due(1050) == ("fewshot", "vtab")  # the last step, off the grid
    assert c.due(150) == ()  # a save off the cadence (none is planned) is not evaluated
    # The plan's counts: the baseline + each multiple of the period up to the last step + the last.
    assert c.evaluations(1, baseline=True) == 1 + 10 + 1
    assert c.evaluations(3, baseline=False) == 3 + 1
    assert EvalCadence((("s", 2),), 100, 1000).evaluations(2, baseline=True) == 1 + 5  # the last is on the grid


def test_evals_settings_are_checked_and_null_suite_turns_every_suite_off():
    config = load_config("vit_h14_i21k")
    assert config.evals.schedule() == (("i21k_fewshot", 2), ("vtab1k_probe", 20))
    off = load_config("vit_h14_i21k", ["evals.suite=null"])
    assert off.evals.schedule() == ()
    with pytest.raises(ValueError, match=r"evals.every=0 must be > 0"):
        load_config("local_demo", ["evals.every=0"]).validate(2, check_paths=False)
    with pytest.raises(ValueError, match=r"evals.budget_fraction=0.0 must be > 0"):
        load_config("local_demo", ["evals.budget_fraction=0"]).validate(2, check_paths=False)
    twice = EvalsConfig(suite="a", extra_suites=(SuiteCadence("a", 4),))
    with pytest.raises(ValueError, match=r"suite\(s\) \['a'\] named twice"):
        twice.validate()


def test_two_suites_of_a_run_with_an_entry_of_one_name_are_refused(tmp_path):
    """Their metrics land on one MLflow key (two few-shot suites: one `fewshot/mean/10shot` curve that alternates
    between two measures); naming one entry gives it keys of its own."""
    suite = tmp_path / "big_fewshot.yaml"
    suite.write_text("name: big_fewshot\nevaluators:\n  - {type: fewshot, datasets: [digits, dsprites_loc]}\n")
    extra = [f"evals.extra_suites=[{{suite: {suite}, every: 2}}]"]
    with pytest.raises(PlanError, match=r"local_fewshot and .*big_fewshot.yaml both have an entry named 'fewshot'"):
        build_plan(load_profile("local"), resolve_config(load_profile("local"), "local_demo", extra, "r"))
    # VTAB-1k fine-tuned beside the recipe's linear probe: one vtab/mean of two protocols
    a100x64 = load_profile("a100x64")
    with pytest.raises(PlanError, match=r"vtab1k and vtab1k_probe both .*'vtab'.* \(`name: vtab1k_probe`\)"):
        build_plan(a100x64, resolve_config(a100x64, "vit_b16_i21k", ["evals.suite=vtab1k"], "b"))
    suite.write_text(suite.read_text().replace("{type: fewshot,", "{type: fewshot, name: fewshot_big,"))
    build_plan(load_profile("local"), resolve_config(load_profile("local"), "local_demo", extra, "r"))


def test_a_checkpoint_due_for_several_suites_runs_them_as_one(tmp_path):
    path = merged_suite(("local_fewshot", "inspect"), tmp_path)
    suite = load_suite(path)
    assert suite.name == "local_fewshot+inspect" and [s.type for s in suite.evaluators] == ["fewshot", "inspect"]


def test_the_plan_knows_every_vtab1k_split_it_prices():
    from cluster.plan.evals.splits import VTAB1K_TEST_IMAGES
    from evals.vtab import VTAB1K_TASKS

    assert set(VTAB1K_TEST_IMAGES) == set(VTAB1K_TASKS)
    assert sum(VTAB1K_TEST_IMAGES.values()) == 387_904  # as docs/vtab.md and configs/evals/vtab1k_probe.yaml say


def _priced_without(profile: str, part: str, **fields) -> ClusterProfile:
    """``profile`` with the fields of its ``part`` (``hardware`` or ``evals``) replaced."""
    p = load_profile(profile)
    return dataclasses.replace(p, **{part: dataclasses.replace(getattr(p, part), **fields)})


REMOTE_CPU_WORKERS = {"gpus_per_node": 0, "peak_tflops": None, "gpu_memory_gb": 0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "profile,sets,message",
    [
        (
            _priced_without("a100x64", "hardware", gpu_type="MI300X"),
            ["deepspeed.precision=fp32"],
            r"no fp32 peak is known for gpu_type 'MI300X' .*train in bf16 \(--set deepspeed\.precision=auto, and "
            r"--set deepspeed\.zero_stage=1 if it is 0",
        ),
        (
            dataclasses.replace(
                _priced_without("a100x8", "hardware", **REMOTE_CPU_WORKERS),
                workers=dataclasses.replace(load_profile("a100x8").workers, gpus_per_worker=0),
                comm_backend="gloo",
            ),
            [],
            r"CPU workers without hardware\.peak_tflops; .*declare the workers' peak TFLOP/s in the profile",
        ),
        (
            _priced_without("a100x64", "evals", gpu_type="X99", peak_tflops=None),
            [],
            r"no bf16 peak is known for evals\.gpu_type='X99' .*or declare evals\.peak_tflops",
        ),
        (
            _priced_without("a100x8", "evals", peak_tflops=None),
            [],
            r"CPU evals on remote nodes without evals\.peak_tflops; declare the eval CPUs' peak",
        ),
        (
            _priced_without("a100x64", "evals", memory_gb=1),
            [],
            r"i21k_fewshot, entry fewshot: needs ~\d\.\d+ GB of host memory .* over the 1 GB it reserves in Ray .*"
            r"raise evals\.memory_gb",
        ),
    ],
    ids=["fp32-peak-unknown", "remote-cpu-workers", "eval-gpu-unknown", "remote-cpu-evals", "eval-host-memory"],
)
def test_a_device_the_plan_cannot_price_or_fit_is_refused_with_the_fix(profile, sets, message):
    """Paths only a cluster's profile takes (a GPU the peak table lacks, remote CPUs, an eval node's host memory)."""
    with pytest.raises(PlanError, match=message):
        build_plan(profile, resolve_config(profile, "vit_b16_i21k", sets, "b"))


@pytest.mark.timeout(60)
def test_the_linear_probe_host_memory_counts_every_tasks_features(tmp_path):
    """The VTAB linear probe keeps each task's float32 features in the suite's feature cache until the suite ends
    (`evals.features.suite_features`), so its host memory holds every task's, plus a float64 copy of the largest task's
    (before: the largest task's alone, ~1 GB short for ViT-H/14 over the 19 tasks' 406,904 images)."""
    (tmp_path / "probe.yaml").write_text(
        "name: probe\nevaluators:\n  - type: vtab\n    benchmark: vtab1k\n    protocol: linear_probe\n"
        "    tasks: [dtd, kitti_dist]\n"
    )
    vit = model_config("vit_tiny_debug", image_size=32, num_classes=10)
    work = evals_cost._entry_work(load_suite(tmp_path / "probe.yaml").evaluators[0], vit, str(tmp_path), "cuda")
    features = vit.representation_size or vit.width
    assert work.host_bytes == features * (4 * (1000 + 1880 + 1000 + 711) + 8 * (1000 + 1880))


@pytest.mark.timeout(60)
def test_fine_tuning_a_hybrid_counts_its_resnet_stems_activations(tmp_path):
    """R26+ViT-S/32 at 64 px keeps ~6.9 MB per image for backward in fp32, ~5.4 MB of it in its ResNet stem, which no
    checkpointing recomputes; the fine-tuning memory counted the encoder alone (~1.5 MB), so a hybrid's fine-tuning
    could be planned to fit and run out of memory at the first checkpoint."""
    (tmp_path / "ft.yaml").write_text(
        "name: ft\nevaluators:\n  - type: finetune\n    datasets: [digits]\n    train_examples: 80\n"
        "    val_examples: 20\n    steps: 10\n    batch_size: 8\n    lr_grid: [0.1]\n    warmup_steps: 2\n"
    )
    spec = load_suite(tmp_path / "ft.yaml").evaluators[0]
    vit = model_config("r26_vit_s32", image_size=64, num_classes=10, representation_size=None)
    work = evals_cost._entry_work(spec, vit, str(tmp_path / "empty"), "cpu")  # fp32, explicit attention
    per_image = evals_cost.finetune_activation_bytes(spec.options, work.model, "cpu") / evals_cost.ACTIVATION_ALLOWANCE
    measured = saved_bytes_per_image(VisionTransformer(work.model).train(), 64)
    assert per_image == pytest.approx(measured, rel=0.03)
    assert memory.stem_activation_bytes(work.model, "fp32") == pytest.approx(5.4e6, rel=0.01)


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the CPU tensors that ops create while it is on (each storage once, until its last tensor
    goes)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, tuple[int, int]] = {}  # data_ptr -> (bytes, live tensors on it)

    def _release(self, ptr: int) -> None:
        size, tensors = self.storages.pop(ptr)
        if tensors > 1:
            self.storages[ptr] = (size, tensors - 1)
        else:
            self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
                ptr = t.untyped_storage().data_ptr()
                size, tensors = self.storages.get(ptr, (t.untyped_storage().nbytes(), 0))
                if not tensors:
                    self.live += size
                    self.peak = max(self.peak, self.live)
                self.storages[ptr] = (size, tensors + 1)
                weakref.finalize(t, self._release, ptr)
        return out


@pytest.mark.timeout(120)
def test_the_inspect_memory_counts_the_attention_weights_it_materialises(tmp_path):
    """Inspection materialises each layer's attention weights (b, heads, T, T) in fp32 and two float64 copies of them
    (`evals.inspection._attention_distance_sum`): ~5x one layer's weights per image at its peak. The plan priced one
    block's activations with SDPA, ~48x short here; for ViT-H/14 at 518 px a batch of 32 needs ~26 GB, planned as ~6."""
    (tmp_path / "inspect.yaml").write_text(
        "name: inspect\nevaluators:\n  - type: inspect\n    num_images: 8\n    num_rollout_images: 2\n"
        "    num_components: 4\n    batch_size: 4\n"
    )
    spec = load_suite(tmp_path / "inspect.yaml").evaluators[0]
    vit = ViTConfig(image_size=96, patch_size=4, width=64, depth=2, num_heads=16, mlp_dim=256, num_classes=0)
    work = evals_cost._entry_work(spec, vit, str(tmp_path), "cuda")
    images = torch.rand(8, 3, 96, 96) * 2 - 1
    with _LiveBytes() as tracked:  # the images and the weights are made before it, the plan counts them apart
        run_inspection(VisionTransformer(vit), images, tmp_path, spec.options)
    planned = work.device_bytes - 4 * flops.param_count(vit) - images.numel() * 4
    assert planned == pytest.approx(tracked.peak, rel=0.05)
    assert work.host_bytes == images.numel() * 4 and "inspect 8 images at 96px" in work.what


@pytest.mark.timeout(120)
def test_the_advice_for_a_gpu_without_a_known_fp32_peak_plans_at_zero_0():
    """At ZeRO-0 `auto` trains fp32 too (DeepSpeed's bf16 needs ZeRO): advising `--set deepspeed.precision=auto` alone
    led back to the same refusal; the advice's `--set`s, all applied, now plan the run in bf16."""
    profile = _priced_without("a100x64", "hardware", gpu_type="MI300X")
    for sets in (["deepspeed.zero_stage=0"], ["deepspeed.zero_stage=0", "deepspeed.precision=fp32"]):
        with pytest.raises(PlanError, match="no fp32 peak is known") as refused:
            build_plan(profile, resolve_config(profile, "vit_b16_i21k", sets, "b"))
        advised = re.findall(r"--set (\S+?)[,:)]? ", str(refused.value))
        assert [s.split("=")[0] for s in advised] == ["deepspeed.precision", "deepspeed.zero_stage"]
        plan = build_plan(profile, resolve_config(profile, "vit_b16_i21k", [*sets, *advised], "b"))
        assert plan.compute.precision == "bf16" and plan.memory.zero_stage == 1


def _paced(hours: float, timeout_h: float, last_step: int) -> tuple[str, ...]:
    """The plan's pace warnings for one suite of ``hours`` per checkpoint, a checkpoint an hour (100 steps of 36 s),
    no baseline."""
    config = TrainConfig(
        checkpoint=CheckpointConfig(every_steps=100), evals=EvalsConfig(suite="s", timeout_s=timeout_h * 3600)
    )
    suite = evals_cost.SuiteCost("s", 1, 0, 1.0, hours, 1.0, 0.0, "")
    part = evals_cost.EvalsPlan("a GPU", 24.0, 0.4, "", 0.1, 0.0, suites=(suite,), baseline=False)
    return evals_cost._pace_warnings(part, config, EvalCadence((("s", 1),), 100, last_step), 36.0)


def test_the_timeout_warning_counts_the_evals_queued_before_the_last_checkpoints():
    """Evals of 3 h a checkpoint, a checkpoint an hour: they fall behind, and at the last of 10 checkpoints six earlier
    ones still wait on the one eval device (their evals end at 13, 16, ..., 28 h), so the last's end at 31 h, 21 h
    after training's: the job's end, waiting 4 h, cancels it. The warning counted the last checkpoint's own 3 h."""
    pace, last = _paced(3.0, 4.0, 1000)
    assert "~3 eval devices to keep up" in pace
    assert "take ~3 h on one eval device, behind ~18 h of earlier checkpoints' still queued" in last
    assert f"--set evals.timeout_s={27 * 3600} " in last  # 21 h and a quarter, in whole hours
    assert not _paced(3.0, 27.0, 1000)[1:]
    # The scheduler pins at most MAX_PINNED checkpoints and skips the rest (never the last): the queue stays bounded.
    (_, long_run) = _paced(3.0, 4.0, 100_000)
    queued = float(re.search(r"behind ~(\d+) h", long_run).group(1))
    assert 18 <= queued <= MAX_PINNED * 3
    # Evals that keep up queue nothing: the last's own hours are all the job's end waits.
    (alone,) = _paced(0.7, 0.5, 1000)
    assert "take ~0.7 h on one eval device (estimated)" in alone and "timeout_s=3600 " in alone


def test_evals_that_keep_up_on_average_but_skip_checkpoints_behind_a_slow_suite_are_warned():
    """One eval device, a checkpoint an hour (100 steps of 36 s): a 0.1 h suite at every checkpoint and a 10 h one at
    every 50th use ~0.3 eval devices on average, but while the slow one runs ten checkpoints come due, and the
    scheduler pins at most MAX_PINNED: it skips the evals of three of them each time, which the plan did not say."""
    config = TrainConfig(
        checkpoint=CheckpointConfig(every_steps=100),
        evals=EvalsConfig(suite="fast", extra_suites=(SuiteCadence("slow", 50),), timeout_s=20 * 3600),
    )
    suites = (
        evals_cost.SuiteCost("fast", 1, 0, 1.0, 0.1, 1.0, 0.0, ""),
        evals_cost.SuiteCost("slow", 50, 0, 1.0, 10.0, 1.0, 0.0, ""),
    )
    part = evals_cost.EvalsPlan("a GPU", 24.0, 0.4, "", 0.1, 0.0, suites=suites, baseline=False)
    cadence = EvalCadence(config.evals.schedule(), 100, 20_000)  # 200 checkpoints, the slow suite at 4 of them
    (skips,) = evals_cost._pace_warnings(part, config, cadence, 36.0)
    assert "would skip the evals of ~9 of the 200 checkpoints due for them" in skips
    assert "behind slow's ~10 h" in skips and f"at most {MAX_PINNED}" in skips
    sets = re.search(r"\((\d+)x: (--set .*?)\)", skips)
    times = int(sets.group(1))
    assert "--set evals.every=" in sets.group(2) and "evals.extra_suites=[{suite: slow, every: " in sets.group(2)
    fixed = EvalCadence((("fast", times), ("slow", 50 * times)), 100, 20_000)
    assert not evals_cost._pace_warnings(part, config, fixed, 36.0)
    # The slow suite alone keeps up: nothing waits behind it beyond the pins.
    alone = dataclasses.replace(part, suites=suites[1:])
    assert not evals_cost._pace_warnings(alone, config, EvalCadence((("slow", 50),), 100, 20_000), 36.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpu,fp32_tflops", [("V100", 15.7), ("T4", 8.1)])
def test_evals_on_a_gpu_without_bf16_are_priced_in_fp32(gpu, fp32_tflops):
    """`precision: auto` fine-tunes in fp32 on a GPU without bf16 tensor cores (`evals.finetune.autocast_dtype`): the
    plan refused such an eval GPU ("no bf16 peak") unless evals.peak_tflops was declared, and then priced its
    fine-tuning at that peak with bf16 activations, half the memory the eval takes."""
    profile = _priced_without("a100x64", "evals", gpu_type=gpu, peak_tflops=None, gpu_memory_gb=80)
    device = evals_cost.eval_device(profile)
    assert list(device.peak_of) == ["fp32"] and device.peak_of["fp32"].tflops == fp32_tflops
    declared = evals_cost.eval_device(_priced_without("a100x64", "evals", gpu_type=gpu, peak_tflops=125.0))
    assert list(declared.peak_of) == ["fp32"]  # the tensor cores' fp16 peak is not the fp32 the evals run at
    spec = load_suite("vtab1k").evaluators[0]
    vit = model_config("vit_b16")
    work = evals_cost._entry_work(spec, vit, "/nonexistent", "cuda", device.cuda_bf16)
    assert work.precision == "fp32"
    checkpointing = spec.options.finetune.activation_checkpointing
    fp32 = memory.vit_activation_bytes(
        work.model, "fp32", dropout=work.model.dropout, activation_checkpointing=checkpointing, sdpa=True
    )
    per_image = evals_cost.finetune_activation_bytes(spec.options.finetune, work.model, "cuda", device.cuda_bf16)
    assert per_image == pytest.approx(evals_cost.ACTIVATION_ALLOWANCE * fp32)
    config = TrainConfig(evals=EvalsConfig(suite="vtab1k", data_root="/nonexistent"))
    cost = suite_cost("vtab1k", vit, config, device)
    assert cost.device_hours == pytest.approx(cost.pflops * 1e15 / (fp32_tflops * 1e12 * device.mfu) / 3600)
