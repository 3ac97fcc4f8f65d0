#!/usr/bin/env bash
# issue 66: the serving benchmark before (bc38bda: the lifecycle in the vLLM face) / after (53fe860:
# kdn.engine.requests) in one run, interleaved; one bench script (main's), each side's kdn in a vLLM venv of its own
set -u
out=/work/logs/ab-serving; mkdir -p $out
args="--docs 8 --concurrency 4 --configs kdn-disk,kdn-redis --workloads docqa,chat"
for round in 1 2; do
  for side in old new; do
    py=/root/.cache/kdn/vllm-venv-$side/bin/python
    echo "=== round $round $side $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/ab.log
    (cd /work/main/benchmarks && KDN_VLLM_PYTHON=$py timeout 2400 python /work/logs/ab-serving/ab_bench.py $args --out $out/$side-$round > $out/$side-$round.log 2>&1)
    echo "=== end $side $round rc $? $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/ab.log
  done
done
