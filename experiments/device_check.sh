#!/usr/bin/env bash
# On a machine with a GPU or a TPU, in under 10 minutes (each step has its own timeout; about 9 minutes
# expected, under the device tool's 600 s per command):
#   1. the kernel tests natively (no interpret mode: kernels default to
#      interpret mode only off their own backend), and the engine's greedy
#      tokens through the native kernels against the XLA path;
#   2. the kernel benchmark at real models' heads (Llama-3-8B, Qwen2.5-7B,
#      SmolLM2), with sizes of >= 1 GB of KV per call and the large-copy peak;
#   3. serving, paged vs contiguous, with random weights (no GGUF or network
#      needed: the packaged ShareGPT request lengths) at SmolLM2 shapes
#      (512 requests, outputs <= 256) and at Llama-3-8B shapes in bf16
#      (128 requests);
#   4. the step profile for the simulated accelerator (SmolLM2 shapes, random
#      weights), with the roofline's efficiencies fitted to it, and the
#      simulator validated against real runs on this device with that
#      profile (docs/simulator.md);
#   5. a short summary, printed last, whatever failed before it.
# Results go to $OUT/device_<backend>/ when $OUT is set (the device tool's
# folder that comes back), else results/device_<backend>/. Exits non-zero
# when a step failed.
# Usage: bash experiments/device_check.sh          (on the accelerator)
#        bash experiments/device_check.sh --smoke  (anywhere: the benchmark and
#          one serving run at tiny sizes, no native tests; checks the plumbing)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
smoke=0
[ "${1:-}" = "--smoke" ] && smoke=1
status=0
step() {  # runs a step; a failure is reported and remembered, and the check goes on
  "$@" || { echo "FAILED (exit $?): $*" >&2; status=1; }
}

backend="$("$PY" -c 'import jax; print(jax.default_backend())')" || exit 1
echo "backend: $backend; $("$PY" -c 'import jax; print(jax.devices())')"
case "$backend" in
  # The hand-worked cases use head dim 2, below Triton's 16-wide tiles; the
  # other backend's kernels would run interpreted, so they are left out.
  # In tests/test_flat_kernel.py the same words pick the native kernel's cases (ids name "gpu" or "tpu").
  gpu) select="(gpu or ragged or dispatch or stacked) and not tpu and not hand"; native="pallas_gpu or pallas_ragged" ;;
  tpu) select="(tpu or dispatch or stacked) and not gpu and not ragged and not hand"; native="pallas_tpu" ;;
  *) if [ "$smoke" = 0 ]; then
       echo "no GPU or TPU here (backend $backend): nothing to check natively (try --smoke)" >&2; exit 2
     fi ;;
esac
dest="${OUT:-results}/device_${backend}"
mkdir -p "$dest"
cache="$dest/.jax_cache"

if [ "$smoke" = 1 ]; then
  step timeout 600 "$PY" -m experiments.kernels.kernel_bench --batches 2 --contexts 64 --ragged-batches 4 \
    --heads smollm2 llama-3-8b --peak-copy-gb 0.01 --out "$dest/kernel_bench"
  step timeout 300 "$PY" -m experiments.simulator.profile_steps --model toy --contexts 16 --decode-steps 2 \
    --staggered-requests 4 --staggered 1 --max-seqs 4 --kv-budget-tokens 2048 --compile-cache "$cache" --out "$dest"
  step timeout 300 "$PY" -m experiments.simulator.validate --model toy --num-requests 4 --max-output-len 4 \
    --max-seqs 4 --kv-budget-tokens 2048 --loads 1 --profile "$dest/step_profile_$backend.csv" \
    --compile-cache "$cache" --out "$dest"
  step timeout 600 "$PY" -m experiments.serving.serve_sharegpt --model smollm2-135m --num-requests 4 --max-output-len 2 \
    --kv-budget-tokens 4096 --compile-cache "$cache" --out "$dest/serve_smollm2-135m"
else
  # 1. The default parameter product of the native kernels and the flat ragged kernel (add -m '' for the full
  #    ones), then the engine (on a GPU or TPU it runs the flat kernel).
  #    tests/test_latent_attention.py: the flat kernel's latent mode (MLA's absorbed form) against dense attention.
  step timeout 130 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_flat_kernel.py \
    tests/test_latent_attention.py -k "$select" --durations=5
  step timeout 80 "$PY" -m pytest -q -p no:cacheprovider -m '' tests/test_kernels_smollm2.py tests/test_llama.py \
    -k "($native) and (engine_at_smollm2 or pallas_kernels_equals_xla)"
  # 2. The benchmark at the presets' heads, large sizes included (the flat kernel's rows: flat_gpu / flat_tpu).
  step timeout 120 "$PY" -m experiments.kernels.kernel_bench --heads llama-3-8b qwen2.5-7b smollm2 --sizes large \
    --batches 64 --contexts 2048 --ragged-batches 128 --min-seconds 0.05 --out "$dest/kernel_bench"
  # 3. Serving with random weights: SmolLM2 shapes (the README's 512-request GPU comparison), then Llama-3-8B in bf16.
  step timeout 100 "$PY" -m experiments.serving.serve_sharegpt --model smollm2-135m --num-requests 512 --max-output-len 256 \
    --kv-budget-tokens 32768 --max-seqs 256 --max-batched-tokens 512 --compile-cache "$cache" \
    --out "$dest/serve_smollm2-135m"
  step timeout 130 "$PY" -m experiments.serving.serve_sharegpt --model llama-3-8b --dtype bfloat16 --kv-dtype bfloat16 \
    --num-requests 128 --max-output-len 128 --kv-budget-tokens 32768 --max-seqs 256 --max-batched-tokens 512 \
    --compile-cache "$cache" --out "$dest/serve_llama-3-8b"
  # 4. The step profile: its CSV is the simulator's profiled step time on this device (and fits the roofline).
  step timeout 60 "$PY" -m experiments.simulator.profile_steps --model smollm2-135m --dtype bfloat16 \
    --kv-dtype bfloat16 --contexts 128 1024 --decode-steps 8 --staggered-requests 16 --staggered 2 \
    --kv-budget-tokens 32768 --max-seqs 64 --compile-cache "$cache" --out "$dest"
  #    The simulator against real runs on this device, its step time fitted to that profile.
  step timeout 80 "$PY" -m experiments.simulator.validate --model smollm2-135m --dtype bfloat16 --kv-dtype bfloat16 \
    --num-requests 64 --max-output-len 128 --kv-budget-tokens 8192 --max-seqs 64 \
    --profile "$dest/step_profile_$backend.csv" --compile-cache "$cache" --out "$dest"
fi
rm -rf "$cache"

# 5. The summary.
step "$PY" -m experiments.kernels.device_summary "$dest"
exit "$status"
