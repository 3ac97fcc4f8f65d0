"""Where the remote tier's put of 8 x 11.8 MB values spends its time through redis-py (the path
before kdn's RESP client wrote): cProfile of RemoteTier._send, busiest functions first.

    PYTHONPATH=python python benchmarks/results/remote/resp_writer/profile_put.py
"""

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from bench_remote import private_redis  # noqa: E402
from kdn import _core  # noqa: E402
from kdn.storage.redis_transport import RedisTransport  # noqa: E402
from kdn.storage.remote import RemoteTier  # noqa: E402

torch.manual_seed(0)
kv = [torch.randn(1, 3, 1024, 64) for _ in range(60)]  # SmolLM2's KV shape: 30 layers x (K, V), 3 heads x 64
with private_redis() as url:
    plain = RedisTransport(url, 1.0, RedisTransport.Options(direct=False))
    for name, tier in (("through redis-py", RemoteTier(url, transport=plain)),
                       ("kdn's RESP client", RemoteTier(url))):
        blobs = [_core.pack_chunk(kv, i * 64, 256, b"\x01" * 16, i.to_bytes(16, "little")) for i in range(8)]
        profile = cProfile.Profile()
        for _ in range(5):
            tier.clear()
            profile.enable()
            tier._send(blobs)
            profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(6)
        print(f"== {name}: 5 puts of 8 x {len(blobs[0]) / 1e6:.1f} MB\n" + out.getvalue())
