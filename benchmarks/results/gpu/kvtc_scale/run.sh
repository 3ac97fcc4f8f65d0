#!/usr/bin/env bash
# How the batched kvtc CUDA decoder scales with the tokens of one call (its symbol kernel runs one
# thread per (plane, rANS lane): 4 lanes per plane, so a 4K-token call is 3,584 threads; a
# 32K-token one 28,672). Built as .ci/gpu builds; run there as: bash benchmarks/results/gpu/kvtc_scale/run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
arch=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')")
KDN_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch" \
  PYTHONPATH=/tmp/site python3 -m pip install --no-deps --no-build-isolation --no-compile --target /tmp/kdn . \
  >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cd benchmarks
for tokens in 4096 16384 32768; do
  extra=""; [ "$tokens" = 32768 ] && extra="--timeline"
  PYTHONPATH=/tmp/kdn:/tmp/site python3 bench_gpu_kvtc.py --tokens "$tokens" --repeats 5 $extra --out "$OUT/tokens$tokens" \
    2>&1 | grep -v "aten::" | tee -a "$OUT/bench.log"
done
