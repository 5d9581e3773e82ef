"""The names under which a run is recorded in MLflow: every metric and tag key is spelled here once.

Training metrics are logged per optimizer step; eval metrics at the checkpoint's step (step 0 = the weights before
the first update). Tags describe the run as a whole.
"""

# Training metrics (pretrain.telemetry.metrics): logged by rank 0 every `logging.log_every` steps.
TRAIN_PREFIX = "train/"
LOSS = "train/loss"  # mean over ranks
LR = "train/lr"
GRAD_NORM = "train/grad_norm"
IMAGES_PER_S = "train/images_per_s"  # all ranks, over the window since the last report
TFLOPS = "train/tflops"  # achieved model FLOP/s per device
MFU = "train/mfu"  # tflops ÷ the device's peak
DATA_WAIT = "train/data_wait"  # fraction of the window spent waiting for the next batch
MEMORY_GB = "train/memory_gb"  # max allocated on CUDA, resident set size on CPU
IMAGES_SEEN = "train/images_seen"  # cumulative
EXAFLOPS = "train/exaflops"  # cumulative: images seen × training FLOPs per image
WORLD_SIZE_METRIC = "train/world_size"  # data-parallel ranks at this step (an elastic job changes it)

# Eval metrics (evals): `<family>/<dataset>/<measure>`, at the checkpoint's step.
EVAL_PREFIXES = ("fewshot/", "finetune/", "vtab/")


def fewshot_mean(shots: int) -> str:  # few-shot accuracy at `shots` images per class, mean over the datasets
    return f"fewshot/mean/{shots}shot"


def finetune_accuracy(dataset: str) -> str:  # test top-1 after fine-tuning on `dataset`
    return f"finetune/{dataset}/accuracy"


FEWSHOT_MEAN_10SHOT = fewshot_mean(10)  # the paper's headline few-shot number
VTAB_MEAN = "vtab/mean"
VTAB_NUM_TASKS = "vtab/num_tasks"
VTAB_NUM_TASKS_EXPECTED = "vtab/num_tasks_expected"

# Params are the flattened resolved config (tracking.tracker.flatten_config); this one holds the run's own id, so
# it is logged only once the run exists.
RUN_ID_PARAM = "logging.mlflow_run_id"

# Tags.
RECIPE = "vitscale.recipe"
MODEL = "vitscale.model"
PROFILE = "vitscale.profile"
WORLD_SIZE = "vitscale.world_size"
STATUS = "vitscale.status"  # running | finished | stopped | failed
GIT_COMMIT = "vitscale.git_commit"
RUN_DIR = "vitscale.run_dir"
RESTARTS = "vitscale.restarts"  # how many times Ray Train restarted the worker group
RESIZES = "vitscale.resizes"  # how many times an elastic job continued at another world size
WORLD_SIZES = "vitscale.world_sizes"  # the world sizes the run trained at, in order, e.g. "2,1,2"
PRECISION = "vitscale.precision"  # fp32 | bf16: what deepspeed.precision (maybe "auto") resolved to on this hardware
PRECISION_RULE = "vitscale.precision_rule"  # which rule decided it (pretrain.config.precision.PrecisionChoice.rule)
PRECISION_REASON = "vitscale.precision_reason"  # the rule's one line: why
PEAK_TFLOPS = "vitscale.peak_tflops"  # the per-device peak train/mfu divides by (pretrain.telemetry.peak)
PEAK_SOURCE = "vitscale.peak_source"  # where that peak comes from (datasheet, declared, measured GEMM)
KIND = "vitscale.kind"  # "comparison" for the runs `make compare` logs its report to
COMPARED_RUNS = "vitscale.compared_runs"

# Faults (docs/elastic.md#faults). The driver's watchdog (cluster.driver.watchdog): hung worker groups it restarted, and
# stragglers (ranks waiting persistently longer for data than the median rank).
HANGS = "vitscale.hangs"  # tag: how many times the watchdog found the group hung and killed the culprit
LAST_HANG = "vitscale.last_hang"  # tag: the watchdog's line about the last one (rank, pid, step, state, why)
HANGS_METRIC = "cluster/hangs"  # the same count, at the step the group was at
FAILURE = "vitscale.failure"  # tag: why training failed, in one line (a failed save's own message)
STRAGGLERS = "vitscale.stragglers"  # tag: the persistent stragglers with their numbers, or "none"
STRAGGLERS_METRIC = "cluster/stragglers"  # how many ranks are persistent stragglers, logged when it changes
# The training stream's counters summed over ranks, logged by the watchdog when they change: read_retries (a shard
# read that failed and was tried again), read_failures (reads given up after data.read_retries retries: the shard
# counts as damaged), and the damage counters of data_pipeline.stream.shards (missing_shards, truncated_shards, ...).
DATA_PREFIX = "data/"


def data_count(counter: str) -> str:  # e.g. data/read_retries
    return f"{DATA_PREFIX}{counter}"


# An eval that failed for good (an exception, a task killed beyond its retries, a damaged checkpoint, the job's end
# reached with it still running past evals.timeout_s): 1 at the checkpoint's step; the reason is the artifact
# eval_failures/step_XXXXXXXX.txt, the count the tag below.
def eval_failed(suite: str) -> str:  # e.g. eval_failed/local_fewshot
    return f"eval_failed/{suite}"


EVAL_FAILURES = "vitscale.eval_failures"  # tag: checkpoints whose eval failed for good
EVAL_FAILURES_DIR = "eval_failures"  # artifact folder: one text file per failed checkpoint, the reason in it
MODEL_URI = "vitscale.model_uri"  # the run's model in MLflow (models:/m-…, tracking.models), shown by make compare
MODEL_STEP = "vitscale.model_step"  # the checkpoint step that model holds
# Tags of the logged model itself (MLflow LoggedModel tags, tracking.models).
MODEL_TAG_STEP = "vitscale.step"
MODEL_TAG_SOURCE = "vitscale.source"  # the checkpoint folder it was exported from
MODEL_TAG_EVAL_PREFIX = "vitscale.eval."  # + an eval mean's metric key, e.g. vitscale.eval.fewshot/mean/10shot

# Goodput (docs/goodput.md): every second of a job's wall-clock lands in exactly one bucket, per attempt and in
# total. Logged over time and at the job's last step; the final table is the artifact GOODPUT_ARTIFACT.
GOODPUT_BUCKETS = (
    "productive",  # optimizer steps whose work the run kept
    "data_wait",  # the training loop waiting for its next batch
    "checkpoint",  # saving checkpoints (the training loop blocked on it)
    "eval_interference",  # evals running on the training job's own cores
    "restart",  # between a failed attempt and the next one's start, plus the steps redone after it (lost work)
    "startup",  # process start, engine build, compile, resume load, universal-checkpoint conversion
    "resource_wait",  # waiting for workers to be placed
    "other",  # whatever the ledger cannot attribute (so the buckets sum to the wall-clock)
)
GOODPUT_PREFIX = "goodput/"
GOODPUT_WALL_S = "goodput/wall_s"  # the job's wall-clock so far
GOODPUT_FRACTION = "goodput/fraction"  # productive_s / wall_s
GOODPUT_ARTIFACT = "goodput"  # artifact folder: ledger.json (per attempt and total) and ledger.txt (the table)


def goodput_bucket(bucket: str) -> str:  # e.g. goodput/data_wait_s
    if bucket not in GOODPUT_BUCKETS:
        raise KeyError(f"unknown goodput bucket {bucket!r}; known: {', '.join(GOODPUT_BUCKETS)}")
    return f"{GOODPUT_PREFIX}{bucket}_s"


# Step-time tails per logging window (pretrain.telemetry.metrics): a loader that stalls one step in fifty shows up in
# p99.
TAIL_PERCENTILES = (50, 90, 99)


def step_time_percentile(p: int) -> str:  # e.g. train/step_s_p99: wall seconds per optimizer step
    return f"train/step_s_p{p}"


def data_wait_percentile(p: int) -> str:  # e.g. train/data_wait_s_p99: seconds one step waited for its batches
    return f"train/data_wait_s_p{p}"


# The data wait the plan predicted (cluster.plan.planner DataPlan.predicted_data_wait, when it has one) and the one
# measured, each a fraction of the training loop's step time, logged by the driver with the final ledger.
GOODPUT_DATA_WAIT_PREDICTED = "goodput/data_wait_predicted"
GOODPUT_DATA_WAIT_MEASURED = "goodput/data_wait_measured"


def finetune_accuracy_at(dataset: str, steps: int) -> str:  # e.g. finetune/digits/accuracy_at_100steps
    # The learning curve: test top-1 of the final fine-tuning run after `steps` of its schedule (evals.finetune).
    return f"finetune/{dataset}/accuracy_at_{steps}steps"
