#!/usr/bin/env bash
# The Python packages that benchmarks/gpu_check.sh needs and the GPU machine's image lacks, gathered into
# .gpu_wheels/ (git-ignored) on a machine that reaches PyPI, to travel with the check (the device tool's `carry`).
#
# The GPU image (this workplace's 'cuda' image: Python 3.12, its own torch and transformers, no registry reachable)
# has torch, transformers, numpy, pytest, hypothesis, pyarrow, tqdm, matplotlib, accelerate, msgpack, requests,
# aiohttp, click, filelock and protobuf, but not dppo's omegaconf and cloudpickle, nor Ray. Ray's wheel (80 MB) is
# over what may travel (64 MiB in all), so it goes as a tarball of the same wheel without the parts dppo never
# imports: its Java jar, the dashboard's web client, rllib, tune, serve, data, train and the runtime-env agent's
# vendored aiohttp (xz, about 26 MB). gpu_check.sh unpacks both into /tmp/dppo-site and puts that on PYTHONPATH.
#
# Usage: bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12, the image's)
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
TAG=cp${PYVER/./}
OUT=.gpu_wheels
RAY_VERSION=$(.venv/bin/python -c 'import ray; print(ray.__version__)' 2>/dev/null || echo 2.60.0)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$1" "${@:2}"
}

rm -rf "$OUT" && mkdir -p "$OUT"
download "$OUT" "omegaconf>=2.3" cloudpickle jsonschema jsonschema-specifications referencing rpds-py

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download "$work" "ray==$RAY_VERSION"
(cd "$work" && unzip -q ray-*.whl && rm -rf ray/jars ray/dashboard/client ray/rllib ray/tune ray/serve ray/data \
  ray/train ray/_private/runtime_env/agent/thirdparty_files &&
  XZ_OPT=-T0 tar -cJf ray-slim.tar.xz ray ray-*.dist-info)
mv "$work/ray-slim.tar.xz" "$OUT/ray-$RAY_VERSION-$TAG-slim.tar.xz"
du -sh "$OUT"/* "$OUT"
