#!/usr/bin/env bash
# the same, kdn-disk only, the order reversed (after first in each round): does the order explain the pairs?
set -u
out=/work/logs/ab-serving; mkdir -p $out
args="--docs 8 --concurrency 4 --configs kdn-disk --workloads docqa,chat"
for round in 3 4; do
  for side in new old; do
    py=/root/.cache/kdn/vllm-venv-$side/bin/python
    echo "=== round $round $side $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/ab.log
    (cd /work/main/benchmarks && KDN_VLLM_PYTHON=$py timeout 2400 python /work/logs/ab-serving/ab_bench.py $args --out $out/$side-$round > $out/$side-$round.log 2>&1)
    echo "=== end $side $round rc $? $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/ab.log
  done
done
