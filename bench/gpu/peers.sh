#!/usr/bin/env bash
# Run HERE (a machine with pip and network), not on the GPU machine: downloads the
# peers the benchmark compares against, as Python 3.12 x86-64 wheels, into .whl/
# (git-ignored), for a GPU machine that has torch, triton, transformers and
# accelerate but no network. bench/gpu/session.sh installs them there.
#
# What travels must stay under the device tool's 64 MiB per call, so:
#  - ray (a hard import of veRL's protocol module) goes as a pruned tree: its Java
#    jar, its GCS and raylet server binaries and the dashboard's web client are
#    dropped (80 MB of wheel; the benchmark imports ray but never starts it);
#  - FlashInfer (a 62 MB wheel plus the CUTLASS DSL and TVM FFI it imports),
#    quack (the CUTLASS DSL) and flash-attn (a CUDA build) do not travel: the
#    suite lists them as not installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
DEST=.whl
rm -rf "$DEST" && mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# download DIR REQUIREMENT...
download() {
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@"
}
# veRL's loss and log-prob modules, and what importing them needs beyond the image.
download "$DEST" verl==0.9.1 omegaconf==2.3.0 codetiming==1.4.0 tensordict==0.10.0 pyvers orjson
# omegaconf pins antlr4 4.9, published only as source: built here (pure Python).
"$PY" -m pip wheel -q --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
# TRL's log-prob helpers and its Triton kernel (trl.kernels), and datasets, which
# trl.trainer.utils imports.
download "$DEST" trl==1.16.0 datasets==5.2.0 dill multiprocess
# pybind11, which building fastrl._C needs: the image's venv python runs CMake's
# check through the base interpreter, which does not see the venv's copy.
download "$DEST" pybind11==3.0.1
# Liger-Kernel: Triton cross entropy and GRPO loss.
download "$DEST" liger-kernel==0.8.5
# ray, pruned (see above), and the schema validator its import needs.
download "$DEST" jsonschema==4.26.0 jsonschema-specifications referencing rpds-py
tmp=$(mktemp -d)
download "$tmp" ray==2.60.0
"$PY" -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp"/ray-*.whl \
    --python-version 3.12 --implementation cp --only-binary=:all: "${PLATFORMS[@]}"
rm -rf "$tmp/site/ray/jars" "$tmp/site/ray/core/src/ray/gcs/gcs_server" "$tmp/site/ray/core/src/ray/raylet/raylet" \
    "$tmp/site/ray/dashboard/client"
tar -C "$tmp/site" -czf "$DEST/ray-2.60.0-pruned.tar.gz" .
rm -rf "$tmp"
du -sh "$DEST"; ls "$DEST"
