"""The GPU campaign of issue #32: one call on a lent GPU measures what the planner and the goals need (docs/benchmarks/
gpu.md says how it is run on the device machine and what then calibrates the planner).

    python -m bench.gpu [--budget-s 480] [--out bench-results/gpu.json] [--smoke]        (make bench-gpu [SMOKE=1])

Parts, in this order, each with its share of ``--budget-s`` (a part past its share is cut short or skipped and says
so; a part that fails records ``error_<part>`` and the campaign goes on; the JSON is rewritten after every part, so
a campaign killed by a timeout keeps what it measured):

- ``data``: a formula-driven set (``rcdb``, 256 classes x 16 images at 224 px: `data_pipeline.builtin.sets`)
  generated on this machine's CPUs, for the real path;
- ``step`` (`bench.gpu.step`): ViT-B/16, L/16 and H/14 steps at the largest micro-batch that fits, eager, with
  activation checkpointing and compiled, against Hugging Face's ViT as it runs by default and compiled: images/s,
  MFU (6 x forward MACs per image x images/s / the dense bf16 peak), the attention kernel of each side;
- ``train`` (`bench.gpu.train`, a child process with a timeout): ``pretrain.train`` through DeepSpeed with the
  ``vit_h14_i21k`` recipe at its micro-batch, loader workers on; a resume from its checkpoint; ZeRO-0/1/2;
- ``loader`` (`bench.gpu.loader`): the training stream alone per CPU core at 224 px, and the cores each measured
  training rate needs;
- ``plan`` (`bench.gpu.plan`): `cluster.plan.planner`'s memory and step time for the real path's configuration against
  it.

The JSON is flat. Beside every number: ``device``, ``device_kind``, ``driver``, ``cuda``, ``torch``, ``deepspeed``,
``transformers``, ``python``, ``date`` and ``commit``. The headline keys: ``mfu_vit_h14``, ``mfu_vit_l16``,
``mfu_vit_b16`` (the best vitscale configuration of the step part; ``mfu_config_<model>`` says which),
``speedup_vs_hf_vit_h14``, ``speedup_vs_hf_vit_b16`` (eager vitscale over HF as it runs by default),
``train_path_mfu_vit_h14``, ``plan_memory_error_vit_h14``, ``plan_step_time_error_vit_h14`` (relative and signed,
(planned - measured) / measured) and ``loader_cores_needed_vit_b16``; each part's own keys are documented in its
module. ``--smoke`` runs every part end to end on the CPU with tiny shapes (a tiny ViT of each model's patch size at
a 2 x 2 grid, 2-3 steps, no compile): the suite's check that the first device call is not the campaign's first run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.gpu import loader as gpu_loader
from bench.gpu import plan as gpu_plan
from bench.gpu import step as gpu_step
from bench.gpu.train import TrainSpec
from data_pipeline.builtin.sets import ensure
from data_pipeline.paths import PROJECT_ROOT
from pretrain.telemetry.peak import device_peak

MODELS = tuple(gpu_step.MODELS)
HEADLINE = (
    "mfu_vit_h14",
    "mfu_vit_l16",
    "mfu_vit_b16",
    "speedup_vs_hf_vit_h14",
    "speedup_vs_hf_vit_b16",
    "train_path_mfu_vit_h14",
    "plan_memory_error_vit_h14",
    "plan_step_time_error_vit_h14",
    "loader_cores_needed_vit_b16",
)
# Each part's share of the budget, in the order they run, and what is kept back for start-up, the summary and a part
# that overruns a little (the step part checks its time between tasks, not inside one).
SHARES = {"data": 0.03, "step": 0.42, "train": 0.48, "loader": 0.05, "plan": 0.02}
SLACK = 0.05
TRAIN_MODEL = "vit_h14"  # the model of the real path's recipe (vit_h14_i21k)


def log(text: str) -> None:
    print(f"[bench.gpu.campaign {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)  # not imported: deepspeed picks its accelerator at import
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _commit() -> str | None:
    try:
        git = ["git", "rev-parse", "HEAD"]
        proc = subprocess.run(git, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


def environment(device: torch.device, smoke: bool, budget_s: float) -> dict:
    """What every number was measured on and with."""
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or platform.machine()})"
    memory = torch.cuda.get_device_properties(device).total_memory / 1e9 if on_gpu else None
    return {
        "device": name,
        "device_kind": gpu_plan.device_kind(name) if on_gpu else "cpu",
        "gpu_memory_gb": memory,
        "driver": _driver(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "smoke": smoke,
        "budget_s": budget_s,
        "precision": "bf16",
    }


def make_data(root: Path, smoke: bool) -> Path:
    """The real path's training set (module docstring), generated by this machine's CPUs."""
    # rcdb's centred contours on a dark background (class_offset 0, background_ramp 0), as the set was measured with
    sizes = dict(resolution=32, num_classes=4, images_per_class=16, samples_per_shard=16, processes=1)
    if not smoke:
        sizes = dict(
            resolution=224,
            num_classes=256,
            images_per_class=16,
            samples_per_shard=256,
            processes=max(1, (os.cpu_count() or 2) - 2),
        )
    return ensure("rcdb", root, val_per_class=1, class_offset=0, background_ramp=0, **sizes) / "train"


def train_spec(data: Path, work: Path, smoke: bool, deadline_s: float) -> TrainSpec:
    spec = TrainSpec(data=str(data), run_root=str(work / "runs"), smoke=smoke, deadline=time.time() + deadline_s)
    if smoke:
        return replace(spec, steps=3, checkpoint_at=2, resume_steps=1, warmup_steps=0, zero_steps=1, num_workers=1)
    return spec


def run_train(spec: TrainSpec, work: Path, timeout_s: float, device: torch.device) -> dict:
    """`bench.gpu.train` in a child process of its own session (a timeout ends it and its loader workers); what it
    wrote, whether it finished or not."""
    spec_path, out_path = work / "train_spec.json", work / "train_out.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)  # carried packages too
    env = {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": device.type}  # DS_ACCELERATOR: make exports cpu
    if device.type == "cpu":  # a smoke run shares a small machine: one thread, as the suite's training runs use
        env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "bench.gpu.train", str(spec_path), str(out_path)]
    proc = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, start_new_session=True)
    result: dict = {}
    try:
        code = proc.wait(timeout=timeout_s)
        if code:
            result["error_train"] = f"bench.gpu.train exited {code} (its output is above)"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result["error_train"] = f"stopped at the part's budget of {timeout_s:.0f} s; what it measured is kept"
    if out_path.is_file():
        result.update(json.loads(out_path.read_text()))
    if isinstance(result.get("train_path_mfu"), float):
        result[f"train_path_mfu_{TRAIN_MODEL}"] = result["train_path_mfu"]
    result["train_path_model_recipe"] = TRAIN_MODEL
    return result


class Campaign:
    """The parts in order, each timed and guarded; the JSON rewritten after each."""

    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out = args, out
        self.device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
        self.spec: TrainSpec | None = None  # the real path's, once the train part has made it
        self.start = time.monotonic()
        self.result = environment(self.device, args.smoke, args.budget_s)

    def share_s(self, part: str) -> float:
        """The part's share of what is left of the budget, among the parts still to run: time an earlier part did not
        use goes to the later ones in proportion."""
        left = self.args.budget_s * (1 - SLACK) - (time.monotonic() - self.start)
        later = list(SHARES)[list(SHARES).index(part) :]
        return max(0.0, left * SHARES[part] / sum(SHARES[p] for p in later))

    def part(self, name: str, work: Callable[[float], dict]) -> None:
        began = time.monotonic()
        log(f"{name}: up to {self.share_s(name):.0f} s")
        try:
            self.result.update(work(self.share_s(name)))
        except Exception as error:  # recorded; the campaign goes on
            self.result[f"error_{name}"] = f"{type(error).__name__}: {str(error)[:400]}"
            log(f"{name} failed: {self.result[f'error_{name}']}")
        self.result[f"seconds_{name}"] = round(time.monotonic() - began, 1)
        self.write()

    def write(self) -> None:
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        tmp.replace(self.out)

    def run(self, work: Path) -> dict:
        smoke = self.args.smoke
        paths: dict[str, Path] = {}

        def data(_: float) -> dict:
            began = time.perf_counter()
            paths["data"] = make_data(work / "data", smoke)
            return {"data_seconds": time.perf_counter() - began, "data_path": str(paths["data"])}

        def step(budget: float) -> dict:
            peak = self.args.peak_tflops or device_peak(None, self.device, "bf16").tflops
            settings = gpu_step.StepSettings(self.device.type, smoke, compile=self.args.compile, peak_tflops=peak)
            settings = gpu_step.smoke_settings(settings) if smoke else settings
            return {"step_peak_tflops": peak, **gpu_step.run(settings, time.monotonic() + budget, log)}

        def train(budget: float) -> dict:
            self.spec = train_spec(paths["data"], work, smoke, budget - 10)  # 10 s to write what it measured
            return run_train(self.spec, work, budget, self.device)

        def loader(_: float) -> dict:
            workers = 0 if smoke else min(8, max(1, (os.cpu_count() or 2) - 2))  # smoke: the per-core rate only
            return gpu_loader.run(paths.get("data"), smoke, workers)

        def plan(_: float) -> dict:
            if self.spec is None:
                raise RuntimeError("the train part made no configuration to plan")
            return gpu_plan.compare(self.spec, self.result, TRAIN_MODEL)

        for name, work_fn in (("data", data), ("step", step), ("train", train), ("loader", loader), ("plan", plan)):
            self.part(name, work_fn)
        self.result.update(gpu_loader.cores_needed(self.result, MODELS))
        for key in HEADLINE:
            self.result.setdefault(key, None)
        self.result["wall_s"] = round(time.monotonic() - self.start, 1)
        self.write()
        return self.result


def summary_lines(r: dict) -> list[str]:
    def pct(key: str) -> str:
        return f"{r[key]:.1%}" if isinstance(r.get(key), float) else "-"

    def num(key: str, fmt: str = ".3g") -> str:
        return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-"

    lines = [f"{r['device']}; torch {r['torch']}, CUDA {r['cuda']}, DeepSpeed {r['deepspeed']}, driver {r['driver']}"]
    for m in MODELS:
        kernels = f"{r.get(f'attention_kernel_vitscale_{m}', '-')} vs HF {r.get(f'attention_kernel_hf_{m}', '-')}"
        lines.append(
            f"{m}: MFU {pct(f'mfu_{m}')} ({r.get(f'mfu_config_{m}', '-')}); eager {pct(f'mfu_eager_{m}')} at "
            f"micro-batch {num(f'eager_batch_{m}')}, {num(f'speedup_vs_hf_{m}', '.2f')}x HF; attention "
            f"{kernels}"
        )
    lines.append(
        f"pretrain.train {TRAIN_MODEL}: MFU {pct('train_path_mfu_vit_h14')}, {num('train_path_img_s')} img/s, "
        f"data wait {pct('train_path_data_wait')}, peak {num('train_path_peak_memory_reserved_gb')} GB, "
        f"checkpoint {num('train_path_checkpoint_gb')} GB in {num('train_path_checkpoint_save_s')} s; resume "
        f"equal losses: {r.get('resume_losses_equal', '-')}"
    )
    lines.append(
        f"ZeRO-0/1/2 step: {num('zero0_step_s')} / {num('zero1_step_s')} / {num('zero2_step_s')} s; plan "
        f"memory error {pct('plan_memory_error_vit_h14')}, step time error "
        f"{pct('plan_step_time_error_vit_h14')}; loader {num('loader_img_s_per_core')} img/s per core, B/16 "
        f"needs {num('loader_cores_needed_vit_b16')} cores"
    )
    errors = sorted(k for k in r if k.startswith("error_"))
    if errors:
        lines.append("errors: " + "; ".join(f"{k}: {r[k]}" for k in errors))
    return lines
