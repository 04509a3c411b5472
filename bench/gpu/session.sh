#!/usr/bin/env bash
# Run ON a lent GPU machine (the device tool), from the repository root:
#
#     FASTRL_BENCH_COMMIT=<HEAD here> bash bench/gpu/session.sh STAGE...
#
# A lease gives 30 minutes of device time and 10 minutes a command, and the
# machine comes back bare after 30 s idle, so every command starts with `setup`
# (about 40 s: installs the peers, builds fastrl._C) and a few stages; with the
# peers carried (bench/gpu/peers.sh, run here first, then `carry: [".whl"]`).
# The first H100 lease (2026-11-24, one start a call, ~1.5 min each) fitted:
#
#     call 1: setup test                   build, then every GPU test (~6 min)
#     call 2: setup bench-logprobs=16384,151936,bfloat16 bench-rest pack
#     call 3: setup bench-logprobs=8192,128256,bfloat16 bench-logprobs=4096,32000,float32 pack
#             (after unpacking call 2's results.tgz here, so that they travel
#             with the tree and the stages add to them)
#
# Stages:
#   setup           installs the carried peers into /tmp/site and builds fastrl
#                   in place (fastrl._C, the CPU kernels; Triton compiles the
#                   GPU kernels on first use)
#   test            the GPU tests (pytest -m gpu: compiled Triton, CUDA graphs,
#                   torch.compile's reduce-overhead mode)
#   test-all        the whole suite (the CPU part also runs in CI)
#   bench-logprobs  python -m bench --op logprobs (its torch.compile
#                   peers take most of the time); starts bench/results/<gpu>.json
#   bench-rest      sampling, policy and kl, merged into that file when it is
#                   this commit's (same GPU model, torch and FASTRL_BENCH_COMMIT),
#                   else starting it
#   bench-logprobs=N,V,DTYPE
#                   one log-prob shape with its peers (about 3 minutes for
#                   16384,151936,bfloat16 on an H100), merged into that file when
#                   it is this commit's, else starting it (no sweeps: the whole
#                   family takes more than one call)
#   profile-sampler the device time of each kernel fastrl.sample launches
#                   (bench/gpu/sampler_profile.py)
#   demo            examples/grpo_tiny.py --compare on the GPU
#   pack            $OUT/results.tgz: bench/results (JSON, plots) and the README
#                   regenerated from them, to unpack over the checkout here
#                   (tar -xzf results.tgz)
# fastrl is built only when the machine has no build of it: after changing
# csrc/ on a warm machine, delete fastrl/_C*.so in the same command.
# Each stage logs to $OUT/<stage>.log; the output ends with one line per stage.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VERL_USE_EXTERNAL_PLUGINS=none
PY=${PY:-python3}
SUMMARY=()

run_stage() {  # run_stage NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    status=$?
    SUMMARY+=("$(printf '%-15s exit %-3s %4ss' "$name" "$status" $((SECONDS - start)))")
    return $status
}

setup() {
    if [ -d .whl ]; then
        # the marker holds the list of what was installed: a warm machine
        # installs again when .whl has changed since
        if [ "$(ls .whl)" != "$(cat /tmp/site/.fastrl-peers 2>/dev/null)" ]; then
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
                for pack in .whl/*.tar.gz; do [ -e "$pack" ] && tar -C /tmp/site -xzf "$pack"; done &&
                ls .whl > /tmp/site/.fastrl-peers || return 1
        fi
    fi
    if ! $PY -c "from fastrl import _backend; assert _backend.native_module()" 2>/dev/null; then
        # PYTHONPATH: CMake asks the base interpreter for pybind11, carried in .whl
        PYTHONPATH=/tmp/site $PY -m pip install -q --no-build-isolation --no-deps -e . || return 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    $PY -m fastrl info
}

# bench_merged ARGS...: the suite with --merge, or without where the results
# file is another commit's (exit 2: refused before anything is timed), so that
# the first stage of a session starts the file and the later ones add to it.
bench_merged() {
    $PY -m bench "$@" --merge --plot bench/results/plots
    local status=$?
    if [ $status -eq 2 ]; then
        $PY -m bench "$@" --plot bench/results/plots
        status=$?
    fi
    return $status
}

status=0
for stage in "$@"; do
    case $stage in
        setup) run_stage setup 420 bash -c "$(declare -f setup); PY=$PY; setup" ;;
        # -v: a run cut short by its limit still logs each test's verdict (the
        # first H100 run's -m gpu suite took over 330 s on 16 workers)
        test) run_stage test 480 $PY -m pytest -v -rfE -m gpu -n 16 -p no:cacheprovider --junitxml "$OUT/junit.xml" ;;
        test-all) run_stage test-all 540 $PY -m pytest -q -n 8 -p no:cacheprovider --junitxml "$OUT/junit-all.xml" ;;
        bench-logprobs) run_stage bench-logprobs 570 $PY -m bench --op logprobs --plot bench/results/plots ;;
        bench-rest) run_stage bench-rest 420 bash -c \
            "$(declare -f bench_merged); PY=$PY; bench_merged --op sampling --op policy --op kl" ;;
        bench-logprobs=*)  # its log's name in the letters a file from $OUT may have
            shape=${stage#bench-logprobs=}
            run_stage "bench-logprobs-${shape//,/-}" 570 bash -c \
                "$(declare -f bench_merged); PY=$PY; bench_merged --op logprobs --shape $shape" ;;
        profile-sampler) run_stage profile-sampler 240 $PY bench/gpu/sampler_profile.py ;;
        demo) run_stage demo 300 $PY examples/grpo_tiny.py --compare --device cuda --plot "$OUT/reward_curve_cuda.png" ;;
        pack) run_stage pack 120 bash -c "$PY -m bench.report && tar -czf '$OUT/results.tgz' bench/results README.md" ;;
        *) echo "unknown stage: $stage" >&2; exit 2 ;;
    esac || status=1
    if [ "$stage" = setup ]; then
        [ $status -ne 0 ] && break
        # the peers setup installed, for the stages after it
        [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
done
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
exit $status
