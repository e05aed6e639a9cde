#!/usr/bin/env bash
# Builds Horovod 0.28.1 from its sdist against the TensorFlow installed in the active Python
# environment and installs it there.
#
# Why a script: Horovod publishes no wheels, and its sdist does not compile against TF >= 2.16
# because horovod/tensorflow/xla_mpi_ops.cc includes XLA headers from their pre-2.16 location.
# That source only backs the experimental HOROVOD_ENABLE_XLA_OPS path, so it is dropped from the
# build; everything else (allreduce, broadcast, the Keras callbacks) is unchanged.
#
# Controllers and transports follow Horovod's own variables: Gloo is on by default; export
# HOROVOD_WITH_MPI=1 for MPI and HOROVOD_GPU_OPERATIONS=NCCL (with NCCL/CUDA present) for GPUs.
# The built wheel is kept in $HOROVOD_WHEEL_CACHE (default ~/.cache/detr_tf/horovod-wheels), keyed
# on the Python and TensorFlow versions, so later runs install it in seconds.
#
# Usage: bash tools/install_horovod.sh        (inside the virtualenv that has tensorflow)
set -euo pipefail

HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-python}

tf_version=$("$PYTHON" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null) || {
  echo "install_horovod.sh: TensorFlow is not importable with '$PYTHON'; install detr_tf first (pip install -e .)" >&2
  exit 1
}
py_tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

if "$PYTHON" - "$HOROVOD_VERSION" <<'PY' 2>/dev/null; then
import sys
import horovod
import horovod.tensorflow  # loads the compiled op library: fails if built for another TF
assert horovod.__version__ == sys.argv[1]
PY
  echo "install_horovod.sh: horovod $HOROVOD_VERSION already works with TensorFlow $tf_version"
  exit 0
fi

# The MPI/NCCL choice is part of the build, so it is part of the cache key.
flavour="gloo${HOROVOD_WITH_MPI:+-mpi}${HOROVOD_GPU_OPERATIONS:+-${HOROVOD_GPU_OPERATIONS}}"
cache_dir=${HOROVOD_WHEEL_CACHE:-$HOME/.cache/detr_tf/horovod-wheels}/${py_tag}-tf${tf_version}-${flavour}
mkdir -p "$cache_dir"
wheel=$(ls "$cache_dir"/horovod-${HOROVOD_VERSION}-*.whl 2>/dev/null | head -n 1 || true)

if [ -z "$wheel" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "install_horovod.sh: building horovod $HOROVOD_VERSION for TensorFlow $tf_version ($flavour) in $work"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  cmake_file="$src/horovod/tensorflow/CMakeLists.txt"
  grep -q 'xla_mpi_ops.cc' "$cmake_file" || {
    echo "install_horovod.sh: $cmake_file no longer lists xla_mpi_ops.cc; the patch needs revisiting" >&2
    exit 1
  }
  sed -i '/xla_mpi_ops\.cc/d' "$cmake_file"
  # Build-time tools Horovod's setup.py imports; the TF it compiles against is the installed one.
  "$PYTHON" -m pip install --quiet "cmake>=3.13,<4" "setuptools<81" wheel cloudpickle psutil pyyaml packaging
  export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
  export HOROVOD_WITH_GLOO=${HOROVOD_WITH_GLOO:-1}
  if [ -z "${HOROVOD_WITH_MPI:-}" ]; then export HOROVOD_WITHOUT_MPI=1; fi
  export MAKEFLAGS="-j$(nproc)"
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$src"
  cp "$work"/dist/horovod-${HOROVOD_VERSION}-*.whl "$cache_dir/"
  wheel=$(ls "$cache_dir"/horovod-${HOROVOD_VERSION}-*.whl | head -n 1)
fi

echo "install_horovod.sh: installing $wheel"
"$PYTHON" -m pip install --quiet --force-reinstall --no-deps "$wheel"
"$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging
"$PYTHON" -c 'import horovod, horovod.tensorflow; print("install_horovod.sh: horovod", horovod.__version__, "OK")'
