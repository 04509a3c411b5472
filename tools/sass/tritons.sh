#!/usr/bin/env bash
# The static sm_90 model (python -m tools.sass) under each Triton our users run, one
# predictions file per version: bench/results/sm90-predicted-triton-<version>.json.
#
#     bash tools/sass/tritons.sh                 every version below (about 5 min each on 2 cores)
#     bash tools/sass/tritons.sh 3.6.0 3.9.0     those only
#
# Why these: a user gets the Triton their torch pins. veRL 0.9.1 pins torch 2.11 ->
# triton 3.6.0 (also the image of the GPU machines this project borrows); OpenRLHF 0.11
# and TRL with vLLM <= 0.31 get torch 2.13 -> 3.7.1; vLLM 0.33 / SGLang 0.5.23 pin torch
# 2.14 -> 3.8.0; 3.9.0 is the newest (and CI's). The versions lower kernels differently
# (before 3.8, tl.histogram is a vote per key bit and a popcount per bin: kernels/_launch.py).
#
# Each version gets a venv of its own under build/tritons/ (kept for the next run):
# torch 2.13.0's CPU wheel beside that Triton, installed alone (--no-deps). The model
# compiles through Triton's own compiler and binder with meta tensors and never runs a
# kernel or asks torch for a GPU, so torch's version does not enter the cubins; only
# Triton's does. Each run uses a Triton cache of its own: a cache is keyed by code, not
# by the Triton that filled it being the one asked (it is, but separate caches also keep
# one version's runs from evicting another's).
# Then bench.report rewrites the README's tables from every results file.
set -euo pipefail
cd "$(dirname "$0")/../.."
# (tests/test_bench.py expects a predictions file for each of these, and no other)
ALL_VERSIONS=(3.6.0 3.7.1 3.8.0 3.9.0)
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("${ALL_VERSIONS[@]}")
PY=${PY:-python3}
ROOT=$PWD
for version in "${VERSIONS[@]}"; do
    venv=build/tritons/$version
    if ! "$venv/bin/python" -c "import torch, triton; assert triton.__version__ == '$version'" 2>/dev/null; then
        rm -rf "$venv"
        "$PY" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q torch==2.13.0 numpy
        "$venv/bin/python" -m pip install -q --no-deps "triton==$version"
        # this checkout, editable (kernels/ is fastrl.kernels), without the C++ build
        FASTRL_NO_NATIVE=1 "$venv/bin/python" -m pip install -q --no-deps -e .
    fi
    echo "=== triton $version"
    TRITON_CACHE_DIR="$ROOT/build/tritons/cache-$version" \
        "$venv/bin/python" -m tools.sass --quiet --json "bench/results/sm90-predicted-triton-$version.json"
done
"$PY" -m bench.report
