#!/usr/bin/env bash
# Run ON a lent GPU machine (the device tool), from the repository root, with the
# peers carried (bench/gpu/peers.sh, run here first, then `carry: [".whl"]`).
#
# A task drawn for a GPU gets 15 minutes of device time in all, each machine start
# (~1.5 min) included, and 10 minutes a command; the machine goes back after 30 s
# idle. So a session spends it in two calls, the second at once on the warm machine:
#
#     call 1 (timeout_s 360):  FASTRL_BENCH_COMMIT=<HEAD here> bash bench/gpu/session.sh quick
#     call 2 (timeout_s: the device time status says is left, less 30 s):
#                              bash bench/gpu/session.sh setup test
#
# and unpacks call 1's results.tgz over the checkout here (tar -xzf results.tgz:
# bench/results/<gpu>.json and the README regenerated from it). Call 1 is the quick
# plan (bench/quick.py), everything important in at most six minutes from a bare
# machine; call 2 the whole GPU test suite (over 330 s on 16 workers on the H100,
# 2026-11-24), whose test.log keeps each verdict should the call be cut short.
# $OUT is the device tool's; elsewhere the logs go to build/gpu-session.
#
# The quick plan's stages and their estimated time on an H100 (python -m bench.quick
# --estimate H100: the bench from the sm_90 model's predicted fastrl times and the
# peers' times measured on the H100 and H200 runs, scaled by the runs' copy
# bandwidth, 13 calls an impl; compiles, imports and the smoke as stated in
# bench/quick.py):
#
#     stage        est.   limit  what
#     setup         20 s    60   the peers' wheels, fastrl installed without its native build
#     build        (40 s)  150   fastrl._C, in the background beside the smoke
#     smoke        100 s   110   37 of the GPU tests (34 node ids, bench/quick.py): every compiled kernel
#                                family in each dtype against the float64 reference, the sampler's split
#                                path, CUDA-graph captures, one torch.compile
#     bench-quick  146 s   rest  python -m bench --plan quick: the canonical shapes beside their
#                                prediction, the peers issue 38 names; bench/results/<gpu>.json
#     pack          10 s    25   the README's tables regenerated, results.tgz
#     total        276 s   345   (QUICK_BUDGET: the call's 360 s less the summary's margin)
#
# Every stage has a hard limit, cut to what the budget has left (the smoke keeps
# 200 s for the bench and pack: the measurements come first); a stage cut short
# leaves its log, the bench its rows measured so far (the results file is rewritten
# after each case, marked incomplete), and pack and the summary still run.
# FASTRL_QUICK_DRY=1 runs the same plumbing on a CPU (tests/test_gpu_plan.py): no
# installs or build, the smoke's node ids collected, not run, the bench at tiny
# stand-ins of its cases, the results and README into $OUT/dry-results and
# $OUT/dry-README.md.
#
# Stages:
#   quick           the quick plan above (setup, build, smoke, bench-quick, pack)
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
#   probe-split     whether a split row's launches repeat their workspace and
#                   outputs bit for bit over identical calls (bench/gpu/split_probe.py)
#   verl-engine     veRL's FSDP engine's prepare_model_outputs patched and not at
#                   16384 x 151936 bf16 (python -m bench.verl_engine): time, logits
#                   traffic counted from the operators, peak memory; $OUT/verl-engine.json
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
    if [ "$limit" -lt 5 ]; then  # timeout 0 would mean no limit
        SUMMARY+=("$(printf '%-15s skipped: the time budget is spent' "$name")")
        return 1
    fi
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    timeout -k 10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    status=$?
    SUMMARY+=("$(printf '%-15s exit %-3s %4ss (limit %ss)' "$name" "$status" $((SECONDS - start)) "$limit")")
    return $status
}

# within CAP RESERVE: CAP seconds, or what the quick plan's budget has left after
# keeping RESERVE seconds for the stages after this one, if less
within() {
    local left=$((QUICK_END - SECONDS - $2))
    echo $((left < $1 ? left : $1))
}

# the carried peers into /tmp/site; the marker holds the list of what was
# installed: a warm machine installs again when .whl has changed since
install_peers() {
    [ -d .whl ] || return 0
    if [ "$(ls .whl)" != "$(cat /tmp/site/.fastrl-peers 2>/dev/null)" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
            for pack in .whl/*.tar.gz; do [ -e "$pack" ] && tar -C /tmp/site -xzf "$pack"; done &&
            ls .whl > /tmp/site/.fastrl-peers || return 1
    fi
}

versions() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}

setup() {
    install_peers || return 1
    if ! $PY -c "from fastrl import _backend; assert _backend.native_module()" 2>/dev/null; then
        # PYTHONPATH: CMake asks the base interpreter for pybind11, carried in .whl
        PYTHONPATH=/tmp/site $PY -m pip install -q --no-build-isolation --no-deps -e . || return 1
    fi
    versions
    $PY -m fastrl info
}

# The quick plan's setup: fastrl installed without fastrl._C (the GPU runs Triton's
# kernels), which build_native then builds in place beside the smoke.
setup_quick() {
    install_peers || return 1
    if ! $PY -c "import fastrl.kernels" 2>/dev/null; then
        FASTRL_NO_NATIVE=1 $PY -m pip install -q --no-build-isolation --no-deps -e . || return 1
    fi
    versions
}

build_native() {
    $PY -c "from fastrl import _backend; assert _backend.native_module()" 2>/dev/null && return 0
    PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace && $PY -m fastrl info
}

# bench_merged ARGS...: the suite with --merge, or without where the results
# file is another commit's (exit 2: refused before anything is timed), so that
# the first stage of a session starts the file and the later ones add to it.
bench_merged() {
    $PY -m bench "$@" --merge
    local status=$?
    if [ $status -eq 2 ]; then
        $PY -m bench "$@"
        status=$?
    fi
    return $status
}

# The quick plan (the header): its stages in order under one budget. A failed
# stage does not stop the next: each reports on its own.
quick() {
    local results=bench/results readme=README.md device=cuda plan_args=() build_pid=""
    if [ "${FASTRL_QUICK_DRY:-0}" = 1 ]; then
        results=$OUT/dry-results readme=$OUT/dry-README.md device=cpu plan_args=(--dry-run)
        mkdir -p "$results" && cp bench/results/*.json "$results"/ && cp README.md "$readme"
        run_stage setup 10 echo "dry run: no peers installed, fastrl as it is here"
        run_stage smoke "$(within 60 0)" $PY -m pytest --collect-only -q -p no:cacheprovider \
            $($PY -m bench.quick --smoke-ids cpu) || status=1
    else
        run_stage setup "$(within 60 0)" bash -c "$(declare -f install_peers versions setup_quick); PY=$PY; setup_quick" ||
            return 1
        [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        # the build's own summary line comes from the wait below
        ( run_stage build 150 bash -c "$(declare -f build_native); PY=$PY; build_native" >/dev/null
          printf '%s\n' "${SUMMARY[-1]}" > "$OUT/.build-summary" ) &
        build_pid=$!
        run_stage smoke "$(within 110 200)" $PY -m pytest -v -rfE -n 8 -p no:cacheprovider --durations 15 \
            --junitxml "$OUT/junit-smoke.xml" $($PY -m bench.quick --smoke-ids cuda) || status=1
    fi
    if [ -n "$build_pid" ]; then
        # the bench times launch-bound cases: no build competing for the CPU
        wait "$build_pid"
        SUMMARY+=("$(cat "$OUT/.build-summary" 2>/dev/null || echo 'build           no summary')")
        rm -f "$OUT/.build-summary"
        grep -q "exit 0 " <<< "${SUMMARY[-1]}" || status=1
    fi
    run_stage bench-quick "$(within 300 25)" bash -c "$(declare -f bench_merged); PY=$PY; bench_merged \
        --plan quick ${plan_args[*]} --results-dir '$results' --plot '$results/plots'" || status=1
    run_stage pack "$(within 25 0)" bash -c "$PY -m bench.report --readme '$readme' --results '$results' &&
        tar -czf '$OUT/results.tgz' '$results' '$readme'" || status=1
}

status=0
QUICK_END=$((SECONDS + ${QUICK_BUDGET:-345}))
for stage in "$@"; do
    case $stage in
        quick) quick ;;
        setup) run_stage setup 420 bash -c "$(declare -f install_peers versions setup); PY=$PY; setup" ;;
        # -v: a run cut short by its limit still logs each test's verdict (the
        # first H100 run's -m gpu suite took over 330 s on 16 workers)
        test) run_stage test 480 $PY -m pytest -v -rfE -m gpu -n 16 -p no:cacheprovider --junitxml "$OUT/junit.xml" ;;
        test-all) run_stage test-all 540 $PY -m pytest -q -n 8 -p no:cacheprovider --junitxml "$OUT/junit-all.xml" ;;
        bench-logprobs) run_stage bench-logprobs 570 $PY -m bench --op logprobs --plot bench/results/plots ;;
        bench-rest) run_stage bench-rest 420 bash -c \
            "$(declare -f bench_merged); PY=$PY; bench_merged --op sampling --op policy --op kl --plot bench/results/plots" ;;
        bench-logprobs=*)  # its log's name in the letters a file from $OUT may have
            shape=${stage#bench-logprobs=}
            run_stage "bench-logprobs-${shape//,/-}" 570 bash -c \
                "$(declare -f bench_merged); PY=$PY; bench_merged --op logprobs --shape $shape --plot bench/results/plots" ;;
        profile-sampler) run_stage profile-sampler 240 $PY bench/gpu/sampler_profile.py ;;
        probe-split) run_stage probe-split 120 $PY bench/gpu/split_probe.py ;;
        verl-engine) run_stage verl-engine 150 $PY -m bench.verl_engine --results "$OUT/verl-engine.json" ;;
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
