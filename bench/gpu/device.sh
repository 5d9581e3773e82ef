#!/usr/bin/env bash
# The GPU campaign's one prepared script (docs/benchmarks/gpu.md).
#
#   bash bench/gpu/device.sh wheels   HERE, once: build and download into .whl/ (git-ignored) the packages the device
#                                     image lacks: DeepSpeed (built from source, pure Python with its ops unbuilt),
#                                     its hjson and pydantic, webdataset, simplejpeg and Pillow 13, for Python 3.12.
#   bash bench/gpu/device.sh          ON THE DEVICE (its tool's `run`, carry [".whl"], timeout_s 480): installs
#                                     .whl/ into the image's python3 and runs the campaign alone (python -m bench.gpu,
#                                     CAMPAIGN_MAX_S): a first call of ~7 minutes with the machine's start, so that a
#                                     rerun fits in the same ~15 minutes of device time; everything lands in $OUT.
#   bash bench/gpu/device.sh tests    ON THE DEVICE, a second call (timeout_s 360): the gpu-marked tests, the H/14
#                                     one first (H14_MAX_S), all within TESTS_MAX_S.
#   CAMPAIGN_MAX_S=N bash bench/gpu/device.sh --parts step,train ...   a rerun of some of it (python -m bench.gpu -h)
#
# Knobs (environment): LIMIT_S (570: the tool's 600 s per command less a margin), CAMPAIGN_MAX_S (360),
# TESTS_MAX_S (300), H14_MAX_S (120).
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = wheels ]; then
    set -e
    mkdir -p .whl
    rm -f .whl/*.whl  # a version left from an earlier pin would make the device's pip refuse the set
    PY=${PY:-.venv/bin/python}  # the project's venv: building DeepSpeed imports torch
    # DeepSpeed has no wheel on PyPI: build one here. DS_BUILD_OPS=0 leaves its C++/CUDA ops unbuilt (the runs use
    # torch's AdamW), so the wheel is pure Python and installs on the device's Python 3.12.
    DS_BUILD_OPS=0 "$PY" -m pip wheel "deepspeed==0.19.8" --no-deps --no-build-isolation -w .whl
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
               --platform manylinux2014_x86_64)
    # The versions the project's venv holds (pydantic pins its pydantic-core exactly).
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 webdataset==1.0.2 braceexpand==0.1.7 simplejpeg==1.9.0 pillow==13.0.0
    du -sh .whl && ls .whl
    exit 0
fi

OUT=${OUT:-bench-results/device}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-570}
CAMPAIGN_MAX_S=${CAMPAIGN_MAX_S:-360}
TESTS_MAX_S=${TESTS_MAX_S:-300}
H14_MAX_S=${H14_MAX_S:-120}
start=$(date +%s)
export PYTHONUNBUFFERED=1
unset DS_ACCELERATOR  # the GPU: DeepSpeed picks CUDA

# Into the image's own python3: the tests' training subprocesses set PYTHONPATH to the project alone.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl \
        || { echo "bench/gpu/device.sh: installing .whl/*.whl failed" | tee "$OUT/campaign.log"; exit 1; }
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, deepspeed, transformers, webdataset; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
} >"$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

if [ "${1:-}" = tests ]; then
    # Sized from the H200 run of 2026-12-04: 7 tests in 200 s, the H/14 one ~60 s of it (DeepSpeed's start, 3 steps, a
    # 12 GB save); the eval-memory cuda case added since takes 17 s on a CPU. The H/14 test runs first, within
    # H14_MAX_S (120), the others in what is left of TESTS_MAX_S (300): at most 300 + 2 x 10 s of kill-after, so the
    # call's timeout_s is 360 with the install and versions (~10 s).
    h14=tests/pretrain/test_gpu_h14.py
    # Only the files that hold gpu-marked tests are collected: the others may import Ray or MLflow, not installed there.
    mapfile -t files < <(grep -rl --include="test_*.py" "mark.gpu" tests | grep -vxF "$h14")
    # pytest's temporary folders live in one this script removes however it ends: `timeout`'s SIGTERM kills pytest
    # without its tests' `finally`, which left the H/14 test's ~12 GB checkpoint on the device's 64 GiB disk.
    tmp=$(mktemp -d /tmp/gpu-tests-XXXXXX)
    trap 'rm -rf "$tmp"' EXIT
    # `timeout` and pytest's processes are a group whose id is timeout's pid; its kill-after reaches pytest alone
    pid=
    trap '[ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null; exit 143' TERM INT
    began=$(date +%s)
    run_tests() {  # LIMIT NAME FILE...
        timeout --kill-after=10 "$1" python3 -m pytest -m gpu -q -p no:cacheprovider -ra \
            --continue-on-collection-errors --basetemp "$tmp/$2" "${@:3}" >>"$OUT/gpu-tests.log" 2>&1 &
        pid=$!
        wait "$pid"
        local code=$?
        kill -KILL -- "-$pid" 2>/dev/null  # what outlived pytest (a training child that ignored SIGTERM) writes no more
        pid=
        rm -rf "${tmp:?}/$2"
        echo "gpu tests ($2): exit $code after $(($(date +%s) - began)) s ($(tail -1 "$OUT/gpu-tests.log"))"
        return $code
    }
    : >"$OUT/gpu-tests.log"
    run_tests "$H14_MAX_S" h14 "$h14"
    code=$?
    left=$((TESTS_MAX_S - ($(date +%s) - began)))
    if [ "$left" -lt 30 ]; then
        echo "gpu tests: only ${left} s of TESTS_MAX_S left for the others" | tee -a "$OUT/gpu-tests.log"
        exit 1
    fi
    run_tests "$left" others "${files[@]}"
    others=$?
    exit $((code ? code : others))
fi

elapsed=$(($(date +%s) - start))
budget=$((LIMIT_S - elapsed - 20))
[ "$budget" -gt "$CAMPAIGN_MAX_S" ] && budget=$CAMPAIGN_MAX_S
if [ "$budget" -lt 120 ]; then
    echo "bench/gpu/device.sh: only ${budget} s left for the campaign" | tee -a "$OUT/campaign.log"
    exit 1
fi
echo "campaign: ${budget} s"
timeout --kill-after=10 $((budget + 15)) python3 -m bench.gpu --budget-s "$budget" --out "$OUT/gpu.json" \
    --work-dir /tmp "$@" >"$OUT/campaign.log" 2>&1
code=$?
# a campaign killed in its train part leaves the part's own JSON (written after every step) and its scratch folder
for partial in /tmp/bench-gpu-*/train_out.json; do [ -f "$partial" ] && cp "$partial" "$OUT/"; done
rm -rf /tmp/bench-gpu-*
tail -12 "$OUT/campaign.log"
echo "campaign: exit $code after $(($(date +%s) - start)) s in all; results in $OUT (gpu.json, campaign.log)"
exit $code
