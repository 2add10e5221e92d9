#!/usr/bin/env bash
# The checks that need a real accelerator, as one short script for a lent machine that has torch but
# no network: every package's tests with --backend BACKEND, exact versus caching pinned bandwidth
# (tools/pinned_bandwidth.py), then swap-bench on it.
#
#   tools/device-check.sh --wheels            # here (with network): build our wheels into .whl/
#   tools/device-check.sh [BACKEND] [PYTEST_ARGS...]
#                                              # there: install .whl/ beside the machine's torch, run
#
# BACKEND is cuda (default), npu, xpu or sim (sim checks the script itself on a CPU machine). Logs and
# the bench JSON go to $OUT (the lending tool's output folder) or ./out/device-check. Each part has its
# own time limit (SWAP_CHECK_TEST_S per package, SWAP_CHECK_BENCH_S for the bench), so one hung part
# cannot take the whole lease; SWAP_CHECK_BENCH_ARGS replaces the bench's "--repeats 7". The exit status is
# the first failing part's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(swap-core swap-adam swap-muon swap-generic swap-ckpt swap-bench)

if [[ "${1:-}" == "--wheels" ]]; then
    rm -rf .whl && mkdir -p .whl
    for package in "${packages[@]}"; do
        python3 -m pip wheel --quiet --no-deps --wheel-dir .whl "packages/$package" || exit
    done
    ls .whl
    exit 0
fi

backend="${1:-cuda}"
shift || true
out="${OUT:-out/device-check}"
mkdir -p "$out"
site="$(mktemp -d)"
export PYTHONUNBUFFERED=1

wheels=(.whl/swap_*.whl)
if [[ ! -e "${wheels[0]}" ]]; then
    echo "no wheels in .whl/: run 'tools/device-check.sh --wheels' first (where pip can reach PyPI)" >&2
    exit 2
fi
# --no-deps: torch, rich and the test tools are the machine's own; only our packages travel.
python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" || exit
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
    python3 -c 'import torch; print("cuda", torch.cuda.is_available() and torch.cuda.get_device_name())' || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} | tee "$out/machine.txt"

status=0
record() { [[ $status -eq 0 && $1 -ne 0 ]] && status=$1; return 0; }

for package in "${packages[@]}"; do
    echo "== pytest $package --backend $backend"
    timeout "${SWAP_CHECK_TEST_S:-150}" python3 -m pytest "packages/$package/tests" --backend "$backend" -q -rfEs \
        -p no:cacheprovider "$@" 2>&1 | tee "$out/tests-$package.log" | tail -n 25
    record "${PIPESTATUS[0]}"
done

echo "== exact-size versus caching pinned buffers: bandwidth"
timeout "${SWAP_CHECK_PINNED_S:-120}" python3 tools/pinned_bandwidth.py --backend "$backend" 2>&1 | tee "$out/pinned-bandwidth.txt"
record "${PIPESTATUS[0]}"

echo "== swap-bench --backend $backend"
# shellcheck disable=SC2086  # SWAP_CHECK_BENCH_ARGS is a list of words
timeout "${SWAP_CHECK_BENCH_S:-150}" python3 -m swap_bench --backend "$backend" ${SWAP_CHECK_BENCH_ARGS:---repeats 7} \
    --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" | tail -n 40
record "${PIPESTATUS[0]}"

echo "device check: exit status $status (logs in $out)"
exit "$status"
