#!/usr/bin/env bash
# The one-GPU checks (README, "GPUs"): run from the repository root on a machine with one GPU
# and JAX's CUDA build; results go to $OUT (default /tmp). Not part of CI.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp}
python3 -c "import jax; print(jax.__version__, jax.devices())"
timeout 120 python3 scripts/gpu/one_gpu_paths.py
timeout 120 python3 scripts/gpu/one_gpu_casts.py
timeout 60 python3 scripts/gpu/one_gpu_refit.py
# Programs over 8 GPUs compiled on this one through JAX's mock GPU topology (read, not run).
timeout 120 python3 scripts/gpu/mock_gpus_schedule.py
timeout 120 python3 scripts/gpu/mock_gpus_options.py
timeout 120 python3 scripts/gpu/mock_gpus_async.py
timeout 120 python3 scripts/gpu/mock_gpus_groups.py
timeout 120 python3 scripts/gpu/mock_gpus_whole.py
timeout 120 python3 scripts/gpu/mock_gpus_ragged.py
timeout 180 python3 scripts/gpu/mock_gpus_units.py
