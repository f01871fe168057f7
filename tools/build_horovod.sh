#!/usr/bin/env bash
# Build Horovod 0.28.1 from its PyPI source against the TensorFlow installed in
# the given Python environment, and install it there.
#
# Horovod's last release does not compile against TensorFlow 2.21 as published:
# one optional file, horovod/tensorflow/xla_mpi_ops.cc (the XLA integration),
# needs headers TensorFlow no longer ships. We drop it from
# horovod/tensorflow/CMakeLists.txt; allreduce, grouped_allreduce, allgather,
# broadcast and DistributedOptimizer all work in graph mode without it.
#
# The built wheel is cached under $EPL_WHEEL_CACHE (default ~/.cache/epl/wheels),
# keyed by the TensorFlow version, so a second setup on the same machine takes
# seconds. CPU machines get Gloo; NCCL is enabled when CUDA and NCCL are found.
#
# Usage: tools/build_horovod.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
HVD_VERSION=0.28.1
if "$PY" -c "import horovod, horovod.tensorflow; assert horovod.__version__ == '$HVD_VERSION'" 2>/dev/null; then
  exit 0
fi
TF_VERSION=$("$PY" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null)
PY_TAG=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
CACHE=${EPL_WHEEL_CACHE:-$HOME/.cache/epl/wheels}/tf-$TF_VERSION-$PY_TAG
mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/horovod-$HVD_VERSION-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  echo "build_horovod: building Horovod $HVD_VERSION against TensorFlow $TF_VERSION (about 8 minutes on 2 cores)" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
  tar -xzf "$work"/horovod-$HVD_VERSION.tar.gz -C "$work"
  src="$work/horovod-$HVD_VERSION"
  # The one file that does not compile against TF 2.21 (XLA integration).
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  "$PY" -m pip install -q cmake wheel setuptools packaging
  export PATH="$(dirname "$PY"):$PATH"
  nccl_flags=(HOROVOD_WITHOUT_MPI=1)
  if command -v nvcc >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q libnccl; then
    nccl_flags+=(HOROVOD_GPU_OPERATIONS=NCCL)
  fi
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 \
      HOROVOD_WITHOUT_MXNET=1 "${nccl_flags[@]}" MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$CACHE"
  wheel=$(ls "$CACHE"/horovod-$HVD_VERSION-*.whl | head -n 1)
fi
"$PY" -m pip install -q --no-deps "$wheel"
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
"$PY" -c "import horovod, horovod.tensorflow as h; print('build_horovod: Horovod', horovod.__version__, 'gloo built:', h.gloo_built())" 2>/dev/null
