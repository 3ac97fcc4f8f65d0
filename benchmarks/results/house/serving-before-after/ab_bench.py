"""bench_serving.py with the vLLM venv taken as given (KDN_VLLM_PYTHON): a before/after run serves another kdn
than this checkout's on purpose."""
import os, sys
sys.path[:0] = ["/work/main/benchmarks", "/work/main/tests"]
import test_vllm
test_vllm.vllm_python = lambda: os.environ["KDN_VLLM_PYTHON"]
import bench_serving
sys.argv[0] = "bench_serving.py"
bench_serving.main()
