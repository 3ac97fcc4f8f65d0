"""Relative error of each layer's keys / values served from a kvtc (per-head) disk tier against the
same pruned hit from the raw memory tier (stories260K, the setting of test_editing's
test_a_kvtc_tier_files_masked_chunks_read_back_exact_where_stored_raw). At 3c3bbee, which stored
masked chunks as if at position 0, the keys' errors read 0.17 / 0.11 / 0.08 / 0.08 / 0.01; from
0ec2e5a on, 0.03 / 0.01 / 0.01 / 0.01 / 0.01 (masked_layout_error.log; for 3c3bbee, run with
PYTHONPATH at a worktree of it holding the same _core build).

    cd benchmarks/results/editing/masked_kvtc && PYTHONPATH=../../../../python python masked_layout_error.py
"""

import tempfile

import torch

import kdn
from kdn import KDN, KDNConfig
from kdn.layout import cache_to_kv_list

model, _ = kdn.models.load("stories260k")
g = torch.Generator().manual_seed(3)
doc = torch.randint(10, 500, (400,), generator=g).tolist()
ids = torch.tensor([doc + torch.randint(10, 500, (20,), generator=g).tolist()])
g = torch.Generator().manual_seed(9)
contexts = [torch.randint(10, 500, (300,), generator=g).tolist() for _ in range(2)]
spec = "kvzip:keep=0.5"
config = dict(chunk_size=128, disk_dir=tempfile.mkdtemp(), disk_codec="kvtc:ratio=4")
writer = KDN(KDNConfig(**config, write_policy="write-through"))
writer.calibrate(model, contexts, per_head=True, progress=False)
writer.deposit(model, doc, edits=[spec])
writer.flush()
exact, _ = writer.retrieve(model, ids[0], edits=spec)
coded, _ = KDN(KDNConfig(**config)).retrieve(model, ids[0], edits=spec)
errors = [float((c - e).norm() / e.norm()) for c, e in zip(cache_to_kv_list(coded), cache_to_kv_list(exact))]
print("keys  ", [round(x, 3) for x in errors[0::2]])
print("values", [round(x, 3) for x in errors[1::2]])
