"""Every MLflow metric and tag name of a run, spelled once. Training metrics are logged per optimizer step, eval
metrics at the checkpoint's step (step 0: the weights before the first update); tags describe the whole run."""

# Training metrics, rank 0, every `logging.log_every` steps.
TRAIN_PREFIX = "train/"
LOSS = "train/loss"  # mean over ranks
LR = "train/lr"
GRAD_NORM = "train/grad_norm"
IMAGES_PER_S = "train/images_per_s"  # all ranks, over the last window: its steps, less saves, switches, start-up
TFLOPS = "train/tflops"  # achieved model FLOP/s per device
MFU = "train/mfu"  # tflops ÷ the device's peak
DATA_WAIT = "train/data_wait"  # fraction of the window waiting for batches
MEMORY_GB = "train/memory_gb"  # max allocated on CUDA, RSS on CPU
IMAGES_SEEN = "train/images_seen"  # cumulative
EXAFLOPS = "train/exaflops"  # cumulative
WORLD_SIZE_METRIC = "train/world_size"  # data-parallel ranks at this step


# Eval metrics (evals): `<entry>/<dataset>/<measure>`, the entry a suite's evaluator type (`fewshot`, `finetune`,
# `vtab`, `inspect`) or the name it was given (`name: vtab1k_probe`). Every metric outside the run's own namespaces
# below (and MLflow's own `system/`) is an eval's; a mean has a `mean` part (`fewshot/mean/10shot`, `vtab/mean`).
def is_eval_metric(key: str) -> bool:
    own = (TRAIN_PREFIX, "cluster/", DATA_PREFIX, GOODPUT_PREFIX, "eval_failed/", "eval_skipped/", "system/")
    return not key.startswith(own)


def is_eval_mean(key: str) -> bool:
    return is_eval_metric(key) and "mean" in key.split("/")


def fewshot_mean(shots: int) -> str:  # mean over the datasets
    return f"fewshot/mean/{shots}shot"


def finetune_accuracy(dataset: str) -> str:  # test top-1 after fine-tuning
    return f"finetune/{dataset}/accuracy"


FEWSHOT_MEAN_10SHOT = fewshot_mean(10)  # the paper's headline number
VTAB_MEAN = "vtab/mean"
VTAB_NUM_TASKS = "vtab/num_tasks"
VTAB_NUM_TASKS_EXPECTED = "vtab/num_tasks_expected"

# Params: the flattened resolved config; the run's id is logged once the run exists.
RUN_ID_PARAM = "logging.mlflow_run_id"

# Tags.
RECIPE = "vitscale.recipe"
MODEL = "vitscale.model"
PROFILE = "vitscale.profile"
WORLD_SIZE = "vitscale.world_size"
STATUS = "vitscale.status"  # running | finished | stopped | failed
GIT_COMMIT = "vitscale.git_commit"
RUN_DIR = "vitscale.run_dir"
RESTARTS = "vitscale.restarts"  # Ray Train restarts of the worker group
RESIZES = "vitscale.resizes"  # continuations at another world size (elastic)
WORLD_SIZES = "vitscale.world_sizes"  # the world sizes trained at, in order, e.g. "2,1,2"
PRECISION = "vitscale.precision"  # fp32 | bf16, as deepspeed.precision resolved
PRECISION_RULE = "vitscale.precision_rule"  # which rule decided it
PRECISION_REASON = "vitscale.precision_reason"  # the rule's one-line why
PEAK_TFLOPS = "vitscale.peak_tflops"  # the per-device peak train/mfu divides by
PEAK_SOURCE = "vitscale.peak_source"  # datasheet, declared or measured GEMM
KIND = "vitscale.kind"  # "comparison" on a comparison report's run
COMPARED_RUNS = "vitscale.compared_runs"

# Faults (docs/elastic.md#faults), from the driver's watchdog.
HANGS = "vitscale.hangs"  # tag: hung worker groups found and restarted
LAST_HANG = "vitscale.last_hang"  # tag: the watchdog's line about the last one
HANGS_METRIC = "cluster/hangs"  # the same count, at the group's step
FAILURE = "vitscale.failure"  # tag: why training failed, in one line
STRAGGLERS = "vitscale.stragglers"  # tag: ranks persistently slower to get data, or "none"
STRAGGLERS_METRIC = "cluster/stragglers"  # their count, logged when it changes
# The training stream's counters (read_retries, read_failures, shard damage), summed over ranks.
DATA_PREFIX = "data/"


def data_count(counter: str) -> str:
    return f"{DATA_PREFIX}{counter}"


# 1 at the step of a checkpoint whose eval failed for good; the reason is a file in EVAL_FAILURES_DIR.
def eval_failed(suite: str) -> str:
    return f"eval_failed/{suite}"


EVAL_FAILURES = "vitscale.eval_failures"  # tag: checkpoints whose eval failed for good


# 1 at the step of a checkpoint whose eval was skipped (too many waiting); the reason is in EVAL_FAILURES_DIR.
def eval_skipped(suite: str) -> str:
    return f"eval_skipped/{suite}"


EVAL_SKIPPED = "vitscale.eval_skipped"  # tag: checkpoints whose eval was skipped
EVAL_FAILURES_DIR = "eval_failures"  # artifact folder: one text file per failed checkpoint
MODEL_URI = "vitscale.model_uri"  # the run's model (models:/m-…, tracking.models)
MODEL_STEP = "vitscale.model_step"  # the checkpoint step that model holds
# Tags of the logged model itself.
MODEL_TAG_STEP = "vitscale.step"
MODEL_TAG_SOURCE = "vitscale.source"  # the checkpoint folder it was exported from
MODEL_TAG_EVAL_PREFIX = "vitscale.eval."  # + an eval mean's key, e.g. vitscale.eval.fewshot/mean/10shot

# Goodput: each second of a job's wall-clock in exactly one bucket (docs/goodput.md, "The buckets").
GOODPUT_BUCKETS = (
    "productive",
    "data_wait",
    "checkpoint",
    "eval_interference",
    "restart",
    "startup",
    "resource_wait",
    "other",
)
GOODPUT_PREFIX = "goodput/"
GOODPUT_WALL_S = "goodput/wall_s"  # the job's wall-clock so far
GOODPUT_FRACTION = "goodput/fraction"  # productive_s / wall_s
GOODPUT_ARTIFACT = "goodput"  # artifact folder: ledger.json and ledger.txt


def goodput_bucket(bucket: str) -> str:
    if bucket not in GOODPUT_BUCKETS:
        raise KeyError(f"unknown goodput bucket {bucket!r}; known: {', '.join(GOODPUT_BUCKETS)}")
    return f"{GOODPUT_PREFIX}{bucket}_s"


# Step-time tails per logging window: a stall every fifty steps shows in p99.
TAIL_PERCENTILES = (50, 90, 99)


def step_time_percentile(p: int) -> str:  # seconds per optimizer step
    return f"train/step_s_p{p}"


def data_wait_percentile(p: int) -> str:  # seconds a step waited for its batches
    return f"train/data_wait_s_p{p}"


# Data wait predicted by the plan and measured, as fractions of step time.
GOODPUT_DATA_WAIT_PREDICTED = "goodput/data_wait_predicted"
GOODPUT_DATA_WAIT_MEASURED = "goodput/data_wait_measured"


def finetune_accuracy_at(dataset: str, steps: int) -> str:  # the final run's test top-1 after `steps`
    return f"finetune/{dataset}/accuracy_at_{steps}steps"
