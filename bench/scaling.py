"""Two-process scaling of the real training loop: images/s at world size 1 and 2 on this machine, same global batch.

Each world size is one ``torchrun ... -m pretrain.train`` of ``configs/local_demo.yaml`` (ZeRO-2 over gloo), each rank
on ``--threads`` / 2 pinned cores; the best of ``--rounds`` alternated runs counts, a run's rate the median logged
images/s after the first window. Keys: docs/benchmarks/2026-11-26-scaling.md; ``notes`` splits the gap to the ideal
into data wait, exchange and compute.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import out_file, stopped, write_json
from bench.train import log
from data_pipeline.cli import fail
from data_pipeline.manifest import read_dataset_info
from data_pipeline.paths import PROJECT_ROOT
from pretrain.model.vit import MODEL_NAMES, build_model, model_config

LOG_LINE = re.compile(r"^step (\d+)/\d+ loss \S+ lr \S+ ([\d.]+) img/s mfu \S+ wait (\d+)%", re.MULTILINE)


def train_command(world: int, args, run_dir: Path) -> list[str]:
    sets = {
        "model.name": args.model,
        "data.image_size": args.image_size,
        "data.global_batch_size": args.global_batch,
        "data.micro_batch_size": args.global_batch // world,
        "data.num_workers": 0,
        "schedule.total": args.steps,
        "schedule.warmup": 1,
        "deepspeed.zero_stage": 2,
        "deepspeed.precision": "fp32",  # the same arithmetic at both sizes
        "checkpoint.dir": str(run_dir),
        "checkpoint.every_steps": args.steps,
        "logging.mlflow_experiment": "null",
        "logging.progress_bar": "false",
        "logging.log_every": args.log_every,
        "logging.peak_tflops": 1.0,  # skips the start-up GEMM measurement
        # plain classification (local_demo's task adds masked patch prediction)
        "task.name": "classification",
        "task.options": "{}",
    }
    if args.data is not None:  # one stream per rank at world size 2
        sets |= {"data.train": args.data, "data.builtin": "null", "data.streams": 2}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    command += ["-m", "pretrain.train", "--config", str(PROJECT_ROOT / "configs" / "local_demo.yaml")]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    return command


def communicate_or_end(proc: subprocess.Popen, timeout: float) -> tuple:
    """``proc.communicate()`` of a torchrun within ``timeout`` s; past it, SIGTERM (torchrun then ends its ranks, which
    run in sessions of their own), SIGKILL 60 s later, and ``subprocess.TimeoutExpired`` with their output."""
    try:
        return proc.communicate(timeout=timeout)
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached torchrun too: it ends its ranks before we go
        _end(proc, 30, (lambda: None, proc.terminate, proc.kill))
        raise
    except subprocess.TimeoutExpired:
        out, err = _end(proc, 60, (proc.terminate, proc.kill))
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None


def _end(proc: subprocess.Popen, grace_s: float, stops: tuple) -> tuple:
    """``proc``'s remaining output once it ended: each of ``stops`` in turn, given ``grace_s`` to work (reading its
    pipes meanwhile, which a bare wait would leave full), then at last waited for."""
    for stop in stops:
        stop()
        try:
            return proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()


def cpu_list(text: str) -> list[int]:
    """The CPUs in a Linux CPU list such as ``0-3,8``."""
    cpus = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def physical_first(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """``cpus`` with one hardware thread of every physical core before any core's second (sysfs topology)."""

    def key(cpu: int) -> tuple[int, int]:
        path = sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            return cpu_list(path.read_text()).index(cpu), cpu
        except (OSError, ValueError):
            return 0, cpu

    return sorted(cpus, key=key)


def start_pinned(command: list[str], cores: list[int], **popen) -> subprocess.Popen:
    """``command`` started on ``cores`` (the ranks torchrun starts inherit them): this process's own affinity around
    the start, not a ``preexec_fn``, whose fork hooks lose a Ctrl-C that arrives in them."""
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        return subprocess.Popen(command, **popen)
    finally:
        os.sched_setaffinity(0, previous)


def run_world(world: int, cores: list[int], args, tmp: Path) -> dict:
    threads = len(cores) // world
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    label = f"world {world} on cores {','.join(map(str, cores))}"
    log(f"{label}: {threads} thread(s) per rank, micro-batch {args.global_batch // world} ...")
    command, pipe = train_command(world, args, tmp), subprocess.PIPE
    start = time.perf_counter()
    proc = start_pinned(command, cores, env=env, cwd=PROJECT_ROOT, stdout=pipe, stderr=pipe, text=True)
    stdout, stderr = communicate_or_end(proc, args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (stdout + stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"{label}: training exited {proc.returncode}:\n" + "\n".join(tail))
    windows = [(int(s), float(rate), int(wait) / 100) for s, rate, wait in LOG_LINE.findall(stdout)]
    if len(windows) < 2:
        raise RuntimeError(f"{label}: fewer than 2 logged windows in the output; raise --steps")
    timed = windows[1:]  # the first window holds the warm-up steps
    img_s = statistics.median(rate for _, rate, _ in timed)
    wait = statistics.median(w for _, _, w in timed)
    step_s = args.global_batch / img_s
    log(f"{label}: {img_s:.1f} img/s ({step_s:.3f} s/step, data wait {wait:.0%}), {wall:.0f} s wall")
    return dict(
        img_s=img_s,
        step_s=step_s,
        data_wait=wait,
        threads=threads,
        cores=cores,
        wall_s=wall,
        windows=[[s, round(r, 2)] for s, r, _ in windows],
    )


def _exchange_worker(rank: int, world: int, port: int, numel: int, repeats: int, cores: list[int], out) -> None:
    share = cores[rank * len(cores) // world : (rank + 1) * len(cores) // world]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grads = torch.ones(numel)
    shard = torch.ones(numel // world)
    gathered = [torch.empty_like(shard) for _ in range(world)]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(grads)  # the gradient reduction (ZeRO-2 on gloo reduces whole buckets)
        dist.all_gather(gathered, shard)  # each rank's updated parameter partition to every rank
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(min(times[1:]))
    dist.destroy_process_group()


def exchange_seconds(numel: int, cores: list[int], repeats: int = 3) -> float:
    """Seconds of one ZeRO-2 step's exchange alone: gradient all-reduce + parameter all-gather of ``numel`` fp32
    values between 2 gloo ranks, each on its half of ``cores``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_exchange_worker, args=(2, port, numel, repeats, cores, queue), nprocs=2, start_method="spawn")
    return queue.get()


def run(args) -> dict:
    params = sum(p.numel() for p in build_model(args.model, num_classes=32, image_size=args.image_size).parameters())
    share = args.threads // 2  # cores per rank; an odd last one stays unused
    cores = physical_first(os.sched_getaffinity(0))[: 2 * share]
    settings = {"world1": (1, cores[:share]), "world2": (2, cores), "world1_all": (1, cores)}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # alternated: a change in the machine's load hits every setting
            for name, (world, its_cores) in settings.items():
                runs[name].append(run_world(world, its_cores, args, Path(tmp) / f"round{i}_{name}"))
    one, two, whole = (max(runs[name], key=lambda run: run["img_s"]) for name in settings)  # least disturbed runs
    exchange = exchange_seconds(params, cores[: 2 * share])
    ratio = two["img_s"] / one["img_s"]
    data_s = two["data_wait"] * two["step_s"]
    compute_s = max(0.0, two["step_s"] - exchange - data_s)
    ideal_s = one["step_s"] / 2
    notes = (
        f"{args.model} at {args.image_size} px, global batch {args.global_batch}, fp32, ZeRO-2 over gloo, "
        f"{share} core(s) and thread(s) per rank: world 1 on {len(one['cores'])} core(s), world 2 on "
        f"{len(two['cores'])}. A world-2 step takes {two['step_s']:.3f} s against an ideal {ideal_s:.3f} s (half of "
        f"world 1's {one['step_s']:.3f} s). Its parts: gradient all-reduce + parameter all-gather of "
        f"{params / 1e6:.1f}M fp32 values, timed alone, {exchange:.3f} s ({exchange / two['step_s']:.0%} of the step; "
        f"deepspeed.overlap_comm is off by default, so it follows the backward pass); data wait "
        f"{two['data_wait']:.0%} of the step (world 1: {one['data_wait']:.0%}); compute and the rest "
        f"{compute_s:.3f} s, {compute_s / ideal_s:.2f}x the ideal step (each rank runs half the micro-batch, and "
        f"gloo's copies, torchrun and the OS share the same cores). World 1 on all {len(whole['cores'])} cores in one "
        f"process: {whole['img_s']:.1f} img/s, so world 2 on the same cores gives "
        f"{two['img_s'] / whole['img_s']:.2f}x (scaling_2_over_1_same_cores; ideally 1.0, more where one process "
        f"uses its {len(whole['cores'])} threads less well than two processes use {share} each). Load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end."
    )
    return dict(
        scaling_2_over_1=ratio,
        img_s_world1=one["img_s"],
        img_s_world2=two["img_s"],
        scaling_2_over_1_same_cores=two["img_s"] / whole["img_s"],
        img_s_world1_all_cores=whole["img_s"],
        step_s_world1=one["step_s"],
        step_s_world2=two["step_s"],
        step_s_world1_all_cores=whole["step_s"],
        data_wait_world1=one["data_wait"],
        data_wait_world2=two["data_wait"],
        exchange_s_world2=exchange,
        exchange_fraction_world2=exchange / two["step_s"],
        compute_s_world2=compute_s,
        threads_per_rank_world1=one["threads"],
        threads_per_rank_world2=two["threads"],
        threads_world1_all_cores=whole["threads"],
        cores_world1=len(one["cores"]),
        cores_world2=len(two["cores"]),
        wall_s_world1=one["wall_s"],
        wall_s_world2=two["wall_s"],
        model=args.model,
        image_size=args.image_size,
        params=params,
        global_batch_size=args.global_batch,
        steps=args.steps,
        rounds=args.rounds,
        img_s_world1_rounds=[r["img_s"] for r in runs["world1"]],
        img_s_world2_rounds=[r["img_s"] for r in runs["world2"]],
        img_s_world1_all_cores_rounds=[r["img_s"] for r in runs["world1_all"]],
        log_every=args.log_every,
        zero_stage=2,
        backend="gloo",
        precision="fp32",
        torch=torch.__version__,
        cpu_count=os.cpu_count(),
        load_average_1min=os.getloadavg()[0],
        windows_world1=one["windows"],
        windows_world2=two["windows"],
        windows_world1_all_cores=whole["windows"],
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    usable = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="vit_s16", choices=MODEL_NAMES)
    add("--image-size", type=int, default=96)
    add("--global-batch", type=int, default=64, help="images per step at both world sizes (even)")
    add("--steps", type=int, default=20)
    add("--log-every", type=int, default=5, help="steps per timing window")
    add("--rounds", type=int, default=2, help="runs per setting, alternated; the best counts")
    add("--threads", type=int, default=min(2, usable), help="cores to use in all, half per rank (an odd one is unused)")
    add("--timeout", type=int, default=600, help="seconds allowed per training run")
    add("--data", metavar="SHARDS", help="shard folder to train on (default: local_demo's rcdb set, made under data/)")
    add("--out", default="bench-results/scaling.json")
    args = parser.parse_args(argv)
    if args.global_batch < 2 or args.global_batch % 2:
        parser.error(f"--global-batch {args.global_batch}: must be even and >= 2 (split over 2 ranks)")
    for flag, value in (("--image-size", args.image_size), ("--timeout", args.timeout), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    if usable < 2:
        parser.error("this process may use only 1 core; two-process scaling needs 2 or more (half per rank)")
    if not 2 <= args.threads <= usable:
        parser.error(f"--threads {args.threads}: must be 2 to {usable}, the cores this process may use (half per rank)")
    if args.log_every < 1 or args.steps < 2 * args.log_every:
        parser.error(f"--steps {args.steps} / --log-every {args.log_every}: need >= 1 and steps >= 2 x log-every")
    try:  # what each training run would refuse, said before any starts
        model_config(args.model, image_size=args.image_size)
    except ValueError as error:
        parser.error(f"--image-size {args.image_size}: {error}")
    if args.data is not None:
        try:
            read_dataset_info(args.data)
        except ValueError as error:
            parser.error(f"--data: {error}")
    if (out := out_file(args.out, parser.prog)) is None:  # before minutes of training
        return 2
    try:
        result = run(args)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return fail(parser.prog, error, status=1)
    except KeyboardInterrupt:
        return stopped(parser.prog, out)
    write_json(out, result)
    print(
        f"world 1 {result['img_s_world1']:.1f} img/s, world 2 {result['img_s_world2']:.1f} img/s: "
        f"{result['scaling_2_over_1']:.2f}x (goal >= 1.7x) -> {out}"
    )
    print(result["notes"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
