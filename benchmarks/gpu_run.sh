#!/usr/bin/env bash
# Measures kmgpu against plain fit and each framework's own data-parallel way on this machine's
# GPUs: one `kmgpu bench` run of one backend, sized for about 10 minutes. The four workloads
# people train (transformer, resnet50_small, xception, resnet50) x {plain fit on 1 GPU, kmgpu
# on 2 GPUs with batch global and per_replica, the peer on 2 GPUs, kmgpu on 1 GPU}, the
# all-reduce sweep (projection), with torch the torchvision reference, and plain fit once more
# after kmgpu (plain's figure is the mean of the runs before and after kmgpu, so kmgpu / plain is
# order-balanced); each run's warm-up, then 3 timed epochs of the workload's steps (--steps N
# changes them), one process per workload. Runs that would not fit the time budget
# (KMGPU_BENCH_BUDGET seconds, default 520) are skipped and say so in the report; the
# workloads run cheapest first. The leading table is printed last.
#
#   bash benchmarks/gpu_run.sh jax        # then the same with torch
#
# Writes $OUT/<name>.{json,md,png,log} (./kmgpu-bench without $OUT), <name> being
# $KMGPU_BENCH_NAME or gpus-<backend>. torch: KMGPU_BENCH_JIT_COMPILE=1 compiles kmgpu's runs
# with jit_compile=True. One report from both runs, on any machine:
#   python -m kmgpu bench --report gpus-jax.json gpus-torch.json --name gpus --out benchmarks/results
# The same code path on a CPU (CI sizes, simulated devices): add --quick.
set -eu
backend=${1:?usage: bash benchmarks/gpu_run.sh jax|torch [more kmgpu bench options]}
shift
case $backend in
  jax|torch|tensorflow) ;;
  *) echo "gpu_run.sh: the backend is jax, torch or tensorflow, not '$backend'" >&2; exit 2 ;;
esac
out=${OUT:-$PWD/kmgpu-bench}
exec python3 -m kmgpu bench --backends "$backend" \
  --workloads transformer,resnet50_small,xception,resnet50 --devices 1,2 \
  --lean --isolate workload --epochs 3 \
  --budget "${KMGPU_BENCH_BUDGET:-520}" --out "$out" \
  --name "${KMGPU_BENCH_NAME:-gpus-$backend}" "$@"
