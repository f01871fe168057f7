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
# After every install (a build, the wheel cache, or Horovod already there),
# scripts/patch_horovod_runner.py patches horovodrun's teardown of a failed job
# in the installed package (pure Python, so no rebuild): without it, the job
# can end 5 s after its first worker failed.
#
# The device kind is EPL_DEVICE (cpu or gpu), else what scripts/select_device.py
# chooses (gpu where nvidia-smi lists a GPU):
# - cpu: Gloo only. Every HOROVOD_GPU* variable is cleared for the build, so a
#   CUDA compiler or an NCCL on the machine never switches it to NCCL.
# - gpu: Gloo and HOROVOD_GPU_OPERATIONS=NCCL.
#   * nvcc: Horovod compiles CUDA kernels (horovod/common/ops/cuda/
#     cuda_kernels.cu), so it needs a CUDA toolkit with nvcc: $CUDA_HOME, else
#     the toolkit of the nvcc on PATH, else /usr/local/cuda. The pip package
#     nvidia-cuda-nvcc-cu12 (which tensorflow[and-cuda] installs) cannot stand
#     in: it ships ptxas and libNVVM but no nvcc (seen in 12.5.82 and 12.9.86).
#     Horovod links that toolkit's CUDA runtime statically, so its CUDA version
#     need not be TensorFlow's 12; the NVIDIA driver must support it.
#   * NCCL: the nvidia-nccl-cu12 package that tensorflow[and-cuda] installs
#     (site-packages/nvidia/nccl: include/nccl.h and lib/libnccl.so.2, the
#     libnccl TensorFlow itself loads), linked as a shared library, found at
#     run time through an RPATH relative to the installed Horovod library
#     ($ORIGIN/../../nvidia/nccl/lib). Without that package: $NCCL_HOME, else
#     whatever Horovod's CMake finds beside the toolkit.
#   * Kernels are compiled for the compute capabilities nvidia-smi reports
#     (HOROVOD_BUILD_CUDA_CC_LIST, e.g. "80,90", overrides; with neither, every
#     capability the nvcc knows, which takes much longer).
#   * Horovod 0.28.1 calls stream_executor::gpu::AsGpuStreamValue, which
#     TensorFlow 2.21 no longer exports (the library would fail to load with an
#     undefined symbol); we define it from TensorFlow's public
#     Stream::platform_specific_handle().
#   Checked without a GPU (nvcc 13.0, nvidia-nccl-cu12 2.32.3, sm_90): it compiles
#   and links; the library's RUNPATH holds $ORIGIN/../../nvidia/nccl/lib; every
#   symbol it needs is defined by the tensorflow 2.21.0 (CUDA) wheel's libraries,
#   libnccl.so.2 or the C/C++ runtime. It has not been loaded on a GPU yet.
#
# The built wheel is cached under $EPL_WHEEL_CACHE (default ~/.cache/epl/wheels)
# in a folder named by the TensorFlow version, the Python tag and, for gpu, the
# device kind and compute capabilities: tf-2.21.0-cp311 (cpu: the name the CPU
# build had before there were kinds, so existing caches stay valid),
# tf-2.21.0-cp311-gpu-nccl-sm90 (gpu). A second setup on the same machine takes
# seconds.
#
# Usage: [EPL_DEVICE=cpu|gpu] scripts/build_horovod.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HVD_VERSION=0.28.1
KIND=$("$PY" "$HERE/select_device.py")
WANT_NCCL=$([ "$KIND" = gpu ] && echo True || echo False)
# The header's patch of horovodrun's teardown, run after every install.
patch_runner() { "$PY" "$HERE/patch_horovod_runner.py"; }
if "$PY" -c "import horovod, horovod.tensorflow as h; assert horovod.__version__ == '$HVD_VERSION'; assert bool(h.nccl_built()) == $WANT_NCCL" 2>/dev/null; then
  patch_runner
  exit 0
fi
TF_VERSION=$("$PY" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null)
PY_TAG=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")

die() { echo "build_horovod: $*" >&2; exit 1; }

# The CUDA toolkit (with nvcc) for the gpu build; see the header.
cuda_home() {
  local nvcc top
  if [ -n "${CUDA_HOME:-}" ]; then
    [ -x "$CUDA_HOME/bin/nvcc" ] || die "CUDA_HOME=$CUDA_HOME has no bin/nvcc"
    echo "$CUDA_HOME"; return
  fi
  # The toolkit around the nvcc on PATH (not a wrapper script's folder).
  if nvcc=$(command -v nvcc); then
    top=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    if [ -x "$top/bin/nvcc" ] && [ -f "$top/include/cuda_runtime.h" ]; then echo "$top"; return; fi
  fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda; return; fi
  die "the gpu build of Horovod compiles CUDA kernels and needs nvcc, and none was found
(CUDA_HOME unset, no CUDA toolkit around an nvcc on PATH, no /usr/local/cuda/bin/nvcc).
The pip package nvidia-cuda-nvcc-cu12 has no nvcc (only ptxas and libNVVM). Install a
CUDA toolkit (any version the NVIDIA driver supports) and set CUDA_HOME to it, or
build for CPU with EPL_DEVICE=cpu."
}

# site-packages/nvidia/nccl of the environment, or nothing.
pip_nccl_root() {
  "$PY" -c "import importlib.util as u, os; s = u.find_spec('nvidia.nccl'); p = list(s.submodule_search_locations or []) if s else []; print(next((d for d in p if os.path.isfile(os.path.join(d, 'include', 'nccl.h'))), ''))" 2>/dev/null || true
}

# Compute capabilities of this machine's GPUs as "80,90", or nothing.
gpu_cc_list() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
    | tr -d ' .' | grep -E '^[0-9]+$' | sort -n -u | paste -sd, - || true
}

key=tf-$TF_VERSION-$PY_TAG
if [ "$KIND" = gpu ]; then
  CUDA_DIR=$(cuda_home)
  CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$(gpu_cc_list)}
  key=$key-gpu-nccl-sm${CC_LIST:-all}
  key=${key//,/-}
fi
CACHE=${EPL_WHEEL_CACHE:-$HOME/.cache/epl/wheels}/$key
mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/horovod-$HVD_VERSION-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  echo "build_horovod: building Horovod $HVD_VERSION ($KIND) against TensorFlow $TF_VERSION (about 8 minutes on 2 cores for cpu)" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
  tar -xzf "$work"/horovod-$HVD_VERSION.tar.gz -C "$work"
  src="$work/horovod-$HVD_VERSION"
  # The one file that does not compile against TF 2.21 (XLA integration).
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  "$PY" -m pip install -q cmake wheel setuptools packaging
  export PATH="$(dirname "$PY"):$PATH"
  # Start from an environment with no Horovod GPU settings of the caller's.
  build_env=(-u HOROVOD_GPU -u HOROVOD_GPU_OPERATIONS -u HOROVOD_GPU_ALLREDUCE
             -u HOROVOD_GPU_ALLGATHER -u HOROVOD_GPU_BROADCAST -u HOROVOD_GPU_ALLTOALL
             -u HOROVOD_GPU_REDUCESCATTER -u HOROVOD_CUDA_HOME -u HOROVOD_NCCL_HOME
             -u HOROVOD_NCCL_INCLUDE -u HOROVOD_NCCL_LIB -u HOROVOD_NCCL_LINK
             HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
             HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)")
  if [ "$KIND" = gpu ]; then
    "$PY" "$HERE/patch_horovod_tf.py" "$src/horovod/tensorflow/mpi_ops.cc"
    build_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$CUDA_DIR"
                PATH="$CUDA_DIR/bin:$PATH")
    if [ -n "$CC_LIST" ]; then build_env+=(HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST"); fi
    nccl=$(pip_nccl_root)
    if [ -n "$nccl" ]; then
      # The wheel ships only libnccl.so.2; CMake's find_library wants libnccl.so.
      mkdir -p "$work/nccl-lib"
      ln -s "$nccl/lib/libnccl.so.2" "$work/nccl-lib/libnccl.so"
      build_env+=(HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$work/nccl-lib"
                  HOROVOD_NCCL_LINK=SHARED
                  LDFLAGS="-Wl,-rpath,\$ORIGIN/../../nvidia/nccl/lib ${LDFLAGS:-}")
    elif [ -n "${NCCL_HOME:-}" ]; then
      build_env+=(HOROVOD_NCCL_HOME="$NCCL_HOME")
    fi
    echo "build_horovod: gpu build: nvcc $("$CUDA_DIR/bin/nvcc" --version | tail -n 2 | head -n 1)," \
         "toolkit $CUDA_DIR, NCCL ${nccl:-${NCCL_HOME:-from CMake search}}," \
         "compute capabilities ${CC_LIST:-all nvcc knows}" >&2
  fi
  env "${build_env[@]}" "$PY" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$CACHE"
  wheel=$(ls "$CACHE"/horovod-$HVD_VERSION-*.whl | head -n 1)
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
patch_runner
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
"$PY" -c "import horovod, horovod.tensorflow as h; print('build_horovod: Horovod', horovod.__version__, 'gloo built:', h.gloo_built(), 'nccl built:', bool(h.nccl_built()))" 2>/dev/null
