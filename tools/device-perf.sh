#!/usr/bin/env bash
# The first speed figures on a real GPU (issue 47), for a lent machine that has torch but no network. It runs
# `swap-bench device-perf` (packages/swap-bench/src/swap_bench/device_perf.py): a bf16 decoder of about 1B parameters,
# sized from the free device memory, trained with AdamW over fp32 masters, plain (on the device) against swapped after
# the backward and swapped inside it (tokens enough for the backward to hide a step's copies, and one row with too
# few), and against torchao's CPUOffloadOptimizer; raw pinned copies each way and both at once, and the link bandwidth
# each swapped step achieved against them. One process per row, medians of alternated iterations, the machine's facts,
# a table and a JSON report.
#
#   tools/device-perf.sh --wheels                # here (with network): our wheels and torchao's into .whl/
#   tools/device-perf.sh cuda|npu|xpu [ARGS...]  # there: install .whl/ beside the machine's torch, run every row
#   tools/device-perf.sh sim [ARGS...]           # anywhere: the dry run, tiny sizes on the simulator (nox runs it)
#
# --wheels builds our wheels with `tools/device-check.sh --wheels` and downloads SWAP_PERF_TORCHAO (default
# torchao==0.18.0, whose compiled kernels load from torch 2.11 on, the lent machines' torch) for CPython
# SWAP_PERF_PYTHON (default 3.12, theirs) on x86-64; SWAP_CHECK_WHEEL_DIR replaces .whl/, as for device-check.sh.
# Without a torchao wheel, or where it cannot be imported, the torchao row is skipped with the reason. The dry run
# (`sim`) uses the packages importable here (the nox session's editable install), not wheels.
#
# ARGS go to `swap-bench device-perf` (--repeats, --swap-times, --model, --check-parity...). The rows get SWAP_PERF_S
# seconds (default 400; a row 180 s at most, and one that would leave the rows after it under 20 s each is not run
# and counts as failed); with the install and the start the script ends within 8 minutes, and is killed at
# SWAP_PERF_S + 50 s. The report is saved after each row, so a run cut short keeps the rows it measured.
#
# The report and the log go to ./out/device-perf, or to $OUT (the lending tool's output folder, which brings back at
# most 8 files of 16 MiB): device-perf.json and device-perf.log, two files of some kB. What travels to the machine is
# the tree (about 3 MB) and .whl/ (our six wheels, under 0.5 MB, and torchao's, 3.4 MB), within the tool's 64 MiB.
# The exit status is swap-bench's: 1 when a row failed, 2 for a usage error, 124 when the time ran out.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit

wheel_dir="${SWAP_CHECK_WHEEL_DIR:-.whl}"
torchao="${SWAP_PERF_TORCHAO:-torchao==0.18.0}"
python_version="${SWAP_PERF_PYTHON:-3.12}"
usage="usage: tools/device-perf.sh --wheels | cuda|npu|xpu|sim [ARGS...]"

if [[ "${1:-}" == "--wheels" ]]; then
    tools/device-check.sh --wheels > /dev/null || exit
    rm -f "$wheel_dir"/torchao-*.whl
    # --no-deps: torchao needs nothing at run time but torch, which the machine has.
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$wheel_dir" "$torchao" || exit
    ls -l "$wheel_dir"
    exit 0
fi

backend="${1:-}"
case "$backend" in
    sim | cuda | npu | xpu) shift ;;
    *)
        echo "$usage" >&2
        exit 2
        ;;
esac

if ! import_error="$(python3 -c 'import torch' 2>&1)"; then
    echo "device perf: $(command -v python3 || echo python3) cannot import torch, which this machine must provide" \
        "(only our packages and torchao travel, as wheels): ${import_error##*$'\n'}" >&2
    exit 2
fi

out="${OUT:-out/device-perf}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if [[ "$backend" != sim ]]; then
    shopt -s nullglob
    wheels=("$wheel_dir"/swap_*.whl)
    extra=("$wheel_dir"/torchao-*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} == 0)); then
        echo "no wheels in $wheel_dir/: run 'tools/device-perf.sh --wheels' first (where pip can reach PyPI)" >&2
        exit 2
    fi
    site="$(mktemp -d)"
    trap 'rm -rf "$site"' EXIT
    # --no-deps: torch and rich are the machine's own; only our packages and torchao travel.
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" ${extra[@]+"${extra[@]}"} ||
        exit
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! import_error="$(python3 -c 'import swap_bench' 2>&1)"; then
    echo "device perf: swap_bench cannot be imported (sim: install the packages here; else: build the wheels):" \
        "${import_error##*$'\n'}" >&2
    exit 2
fi

budget="${SWAP_PERF_S:-400}"
echo "# $(date -u +%FT%TZ) tools/device-perf.sh $backend $*" | tee "$out/device-perf.log"
timeout -k 10 "$((budget + 50))" python3 -m swap_bench device-perf --backend "$backend" --budget-s "$budget" \
    --json "$out/device-perf.json" "$@" 2>&1 | tee -a "$out/device-perf.log"
status=${PIPESTATUS[0]}
echo "device perf --backend $backend: exit status $status after $SECONDS s (report and log in $out)" |
    tee -a "$out/device-perf.log"
exit "$status"
