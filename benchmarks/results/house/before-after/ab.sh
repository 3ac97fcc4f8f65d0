#!/usr/bin/env bash
# before (bc38bda: the lifecycle in the vLLM face) / after (HEAD: kdn.engine.requests) in one run, interleaved
set -u
out=/work/logs/ab; mkdir -p $out
args="--configs vllm,kdn-memory,kdn-disk --no-lmcache --docs 2 --questions 3 --tokens 2000"
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then dir=/work/old/benchmarks; py=/root/.cache/kdn/vllm-venv-old/bin/python
    else dir=/work/main/benchmarks; py=/root/.cache/kdn/vllm-venv/bin/python; fi
    echo "=== round $round $side $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $out/ab.log
    (cd $dir && KDN_VLLM_PYTHON=$py timeout 1500 $py bench_vllm.py $args --out $out/$side-$round >> $out/$side-$round.log 2>&1)
    echo "=== end $side $round rc $? $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $out/ab.log
  done
done
