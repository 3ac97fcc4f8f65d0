#!/usr/bin/env bash
# A device check of a change to the CUDA decoder: the CUDA tests on the working tree (.ci/gpu tests),
# then bench_gpu_kvtc on it and on the commit before the change, alternated (after, before) x 2.
# Before the call, here: git archive <commit before> -o .gpu/before.tar (.gpu and .whl are ignored;
# carry both). Run there as: bash benchmarks/results/gpu/before_after.sh [bench_gpu_kvtc options]
# Results: $OUT/{after,before}{1,2}/, $OUT/bench.log, $OUT/tests_cuda.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-gpu_out}")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
arch=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')")
mkdir -p /tmp/before && tar -xf .gpu/before.tar -C /tmp/before
(cd /tmp/before && KDN_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=8 CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch" \
  PYTHONPATH=/tmp/site python3 -m pip install --no-deps --no-build-isolation --no-compile --target /tmp/kdn_before . \
  >/tmp/build_before.log 2>&1; echo "before built: $?"; tail -5 /tmp/build_before.log) &
OUT=$OUT bash .ci/gpu tests; echo "tests: $?"
wait
cd benchmarks
for i in 1 2; do
  PYTHONPATH=/tmp/kdn:/tmp/site python3 bench_gpu_kvtc.py "$@" --out "$OUT/after$i" 2>&1 | tee -a "$OUT/bench.log"
  PYTHONPATH=/tmp/kdn_before:/tmp/site python3 bench_gpu_kvtc.py "$@" --out "$OUT/before$i" 2>&1 | tee -a "$OUT/bench.log"
done
