#!/usr/bin/env bash
# The checks that need a real accelerator, for a lent machine that has torch and pytest but no network. Two
# parts, each sized to at most SWAP_CHECK_PART_S seconds (default 480: one lent command may run 10 minutes):
#
#   part1  swap-core's hardware risks (packages/swap-core/tests/test_hardware_risks.py, CUDA only), then the
#          swap-core, swap-adam and swap-muon suites
#   part2  the swap-generic, swap-ckpt and swap-bench suites, a CUDA sanitizer pass over one parity test per
#          family (TORCH_CUDA_SANITIZER=1), pinned bandwidth with the machine's facts (tools/pinned_bandwidth.py)
#          and a short swap-bench run
#
#   tools/device-check.sh --wheels                              # here (with network): build our wheels into .whl/
#   tools/device-check.sh part1|part2|all [BACKEND] [PYTEST_ARGS...]   # there: install .whl/ beside torch, run
#
# BACKEND is cuda (default), npu, xpu or sim: `tools/device-check.sh part1 sim` checks the script itself on a CPU
# machine. `all` runs both parts, one after the other (twice the time: not for one lent command); a first argument
# that names a backend means `all` (the form before the parts existed). PYTEST_ARGS go to every suite's pytest.
#
# With a real backend the plugin runs each test under one simulator schedule (--sim-schedules one; on `sim` the
# script asks for the same, so the selection matches) and skips the simulator's own tests. Every test has a time
# limit (--per-test-timeout SWAP_CHECK_TEST_TIMEOUT_S, default 60): a slow test fails and the suite goes on; one
# hung in a device call ends its pytest, and the part goes on with its next step. Each step gets what is left of
# the part's time, less what the steps after it are guaranteed (the sanitizer 90 s, the bandwidth 45 s, the bench
# 150 s: SWAP_CHECK_SANITIZER_S, SWAP_CHECK_PINNED_S, SWAP_CHECK_BENCH_S); a step with under 15 s left is not run
# and counts as failed (status 124). SWAP_CHECK_BENCH_ARGS replaces the bench's "--repeats 7" ("--quick" on sim).
# SWAP_CHECK_WHEEL_DIR replaces .whl/ (both for --wheels and for the install). Logs, per-step times
# (timings.txt), the bandwidth and bench JSON go to ./out/device-check, or to $OUT (the lending tool's output
# folder, which brings back only a few files: there the logs and JSON are packed into device-check-PART.tar.gz
# at the end, beside timings.txt). The exit status is the first failing step's.
#
# Measured on an H200 (torch 2.11, 2026-12-04, a sample: hardware risks in full, parity tests only): a pytest start
# costs about 10 s, a conformance parity test 0.05-0.5 s, the 18 hardware risks 36 s, the sanitizer pass 16 s,
# the bandwidth 9 s. On the simulator (2-core CPU VM, all tests that run there) part 1 took 120-240 s and part 2
# 145-205 s (two runs each, other work changing the tree in between).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(swap-core swap-adam swap-muon swap-generic swap-ckpt swap-bench)
wheel_dir="${SWAP_CHECK_WHEEL_DIR:-.whl}"

if [[ "${1:-}" == "--wheels" ]]; then
    mkdir -p "$wheel_dir" && rm -f "$wheel_dir"/swap_*.whl
    for package in "${packages[@]}"; do
        python3 -m pip wheel --quiet --no-deps --wheel-dir "$wheel_dir" "packages/$package" || exit
    done
    ls "$wheel_dir"
    exit 0
fi

parts=all
case "${1:-}" in
    part1 | part2 | all) parts="$1" && shift ;;
esac
backend="${1:-cuda}"
shift || true
case "$backend" in
    sim | cuda | npu | xpu) ;;
    *)
        echo "usage: tools/device-check.sh --wheels | part1|part2|all [sim|cuda|npu|xpu] [PYTEST_ARGS...]" >&2
        exit 2
        ;;
esac

if ! import_error="$(python3 -c 'import torch, pytest' 2>&1)"; then
    echo "device check: $(command -v python3 || echo python3) cannot import torch and pytest, which this machine" \
        "must provide (only our packages travel, as wheels): ${import_error##*$'\n'}" >&2
    exit 2
fi

out="${OUT:-out/device-check}"
mkdir -p "$out"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
export PYTHONUNBUFFERED=1

wheels=("$wheel_dir"/swap_*.whl)
if [[ ! -e "${wheels[0]}" ]]; then
    echo "no wheels in $wheel_dir/: run 'tools/device-check.sh --wheels' first (where pip can reach PyPI)" >&2
    exit 2
fi
# --no-deps: torch, rich and the test tools are the machine's own; only our packages travel.
python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" || exit
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{
    python3 -c 'import sys, torch, pytest; print("python", sys.version.split()[0], "torch", torch.__version__,
        "pytest", pytest.__version__)'
    python3 -c 'import swap_core; print("swap_core from", swap_core.__file__)'
    python3 -c 'import torch; print("cuda", torch.cuda.is_available() and torch.cuda.get_device_name())' || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} | tee "$out/machine.txt"

part_s="${SWAP_CHECK_PART_S:-480}"
sanitizer_s="${SWAP_CHECK_SANITIZER_S:-90}"
pinned_s="${SWAP_CHECK_PINNED_S:-45}"
bench_s="${SWAP_CHECK_BENCH_S:-150}"
pytest_args=(-rfEs -p no:cacheprovider --backend "$backend" --sim-schedules one
    --per-test-timeout "${SWAP_CHECK_TEST_TIMEOUT_S:-60}" --durations 10)
if [[ "$backend" == sim ]]; then
    bench_args="${SWAP_CHECK_BENCH_ARGS:---quick}"
else
    bench_args="${SWAP_CHECK_BENCH_ARGS:---repeats 7}"
fi
# One parity test per family, one schedule each (plus RMSprop per tensor: the other layout's stream ordering, and
# RMSprop stepping inside the backward: updates issued from gradient hooks).
sanitized_tests=(
    "packages/swap-core/tests/test_rmsprop_conformance.py::test_conformance_parity[lazy0-on-on-rmsprop]"
    "packages/swap-core/tests/test_rmsprop_conformance.py::test_conformance_parity[lazy0-off-on-rmsprop]"
    "packages/swap-core/tests/test_rmsprop_conformance.py::test_conformance_options[lazy0-step=in_backward-rmsprop]"
    "packages/swap-adam/tests/test_adam_conformance.py::test_conformance_parity[lazy0-on-on-adam]"
    "packages/swap-muon/tests/test_muon_conformance.py::test_conformance_parity[lazy0-on-on-muon_defaults]"
    "packages/swap-generic/tests/test_generic_conformance.py::test_conformance_parity[lazy0-on-on-sgd_momentum]"
)

status=0
record() { [[ $status -eq 0 && $1 -ne 0 ]] && status=$1; return 0; }

# run_step NAME LIMIT_S COMMAND...: COMMAND under a time limit, its output in $out/NAME.log (the tail shown here).
run_step() {
    local name="$1" limit="$2"
    shift 2
    if ((limit < 15)); then
        echo "== $name: not run, the part's ${part_s} s are spent" | tee "$out/$name.log" | tee -a "$out/timings.txt"
        record 124
        return 0
    fi
    echo "== $name (at most $limit s)"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$out/$name.log"
    echo "== $name: exit status $rc after $((SECONDS - started)) s" | tee -a "$out/timings.txt"
    record "$rc"
}

# left RESERVED_S: the seconds left in this part, less those the steps after it are guaranteed.
left() { echo $((deadline - SECONDS - $1)); }

suite() { # suite PACKAGE RESERVED_S [ARGS...]
    local package="$1" reserved="$2"
    shift 2
    run_step "tests-$package" "$(left "$reserved")" \
        python3 -m pytest "packages/$package/tests" -q "${pytest_args[@]}" "$@" "${extra_args[@]}"
}

extra_args=("$@")

part1() {
    deadline=$((SECONDS + part_s))
    echo "=== part 1 --backend $backend: hardware risks, swap-core, swap-adam, swap-muon (at most $part_s s)"
    run_step hardware-risks "$(left 0)" python3 -m pytest packages/swap-core/tests/test_hardware_risks.py \
        "${pytest_args[@]}" -v "${extra_args[@]}"
    suite swap-core 0 --ignore=packages/swap-core/tests/test_hardware_risks.py
    suite swap-adam 0
    suite swap-muon 0
}

part2() {
    deadline=$((SECONDS + part_s))
    echo "=== part 2 --backend $backend: swap-generic, swap-ckpt, swap-bench, sanitizer, bandwidth, bench" \
        "(at most $part_s s)"
    local after_suites=$((sanitizer_s + pinned_s + bench_s))
    suite swap-generic "$after_suites"
    suite swap-ckpt "$after_suites"
    suite swap-bench "$after_suites"
    local limit
    limit="$(left $((pinned_s + bench_s)))"
    ((limit > sanitizer_s)) && limit=$sanitizer_s
    if [[ "$backend" == cuda ]]; then
        run_step cuda-sanitizer "$limit" env TORCH_CUDA_SANITIZER=1 \
            python3 -m pytest "${sanitized_tests[@]}" "${pytest_args[@]}" -v
    else  # the same selection without the sanitizer: the test ids still exist
        echo "== cuda-sanitizer: needs --backend cuda; running its selection without it"
        run_step cuda-sanitizer-selection "$limit" python3 -m pytest "${sanitized_tests[@]}" "${pytest_args[@]}" -v
    fi
    limit="$(left "$bench_s")"
    ((limit > pinned_s)) && limit=$pinned_s
    run_step pinned-bandwidth "$limit" python3 tools/pinned_bandwidth.py --backend "$backend" \
        --json "$out/pinned-bandwidth.json"
    limit="$(left 0)"
    ((limit > bench_s)) && limit=$bench_s
    # shellcheck disable=SC2086  # bench_args is a list of words
    run_step bench "$limit" python3 -m swap_bench --backend "$backend" $bench_args --json "$out/bench.json"
}

echo "# $(date -u +%FT%TZ) $parts --backend $backend" >> "$out/timings.txt"
case "$parts" in
    part1) part1 ;;
    part2) part2 ;;
    all) part1; part2 ;;
esac

if [[ -n "${OUT:-}" ]]; then  # the lending tool brings back a few files: one archive of the logs, and the times
    (
        cd "$out" && shopt -s nullglob && logs=(*.log *.json machine.txt) && ((${#logs[@]} > 0)) &&
            tar -czf "device-check-$parts.tar.gz" "${logs[@]}" && rm -f "${logs[@]}"
    ) || echo "device check: the logs in $out could not be packed; they stay as they are" >&2
fi
echo "device check $parts --backend $backend: exit status $status after $SECONDS s (logs in $out)"
exit "$status"
