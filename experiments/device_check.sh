#!/usr/bin/env bash
# On a machine with a GPU or a TPU: the kernel tests natively (no interpret
# mode: kernels default to interpret mode only off their own backend) and the
# benchmark, in under five minutes. Usage: bash experiments/device_check.sh
# Writes results/kernel_bench_<backend>.{md,csv}; exits non-zero on a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"

backend="$("$PY" -c 'import jax; print(jax.default_backend())')"
echo "backend: $backend; $("$PY" -c 'import jax; print(jax.devices())')"
case "$backend" in
  # The hand-worked cases use head dim 2, below Triton's 16-wide tiles; the
  # other backend's kernels would run interpreted, so they are left out.
  gpu) select="(gpu or ragged or dispatch) and not tpu and not hand"; smol="pallas_gpu or pallas_ragged" ;;
  tpu) select="(tpu or dispatch) and not gpu and not ragged and not hand"; smol="pallas_tpu" ;;
  *) echo "no GPU or TPU here (backend $backend): nothing to check natively" >&2; exit 2 ;;
esac

# The default parameter product of the native kernels (add -m '' for the full one).
timeout 180 "$PY" -m pytest -q tests/test_kernels.py -k "$select" -x --durations=5
# Greedy SmolLM2 through the native kernel equals the XLA path.
timeout 60 "$PY" -m pytest -q -m '' tests/test_kernels_smollm2.py -k "$smol" -x || {
  echo "SmolLM2 check failed or timed out" >&2; exit 1; }
timeout 120 "$PY" -m experiments.kernel_bench --batches 1 8 32 128 --contexts 256 1024 2048 4096 \
  --ragged-batches 32 128 --out "results/kernel_bench_${backend}"
