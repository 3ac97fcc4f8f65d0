"""The scheduler-to-worker lookup channel (kdn.integrations.lookups): answers come from the worker's
lookup, a dead or failing worker is "no answer" (the scheduler then asks its own tiers), and the
socket lives in a folder only its user can open."""

import os
import stat

import numpy as np

from kdn.integrations.lookups import LookupClient, LookupServer, socket_path


def test_the_worker_answers_and_a_gone_or_failing_worker_is_no_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = socket_path("engine-a|store")
    assert path != socket_path("engine-b|store")  # one socket per vLLM engine and store
    seen = []

    def lookup(tokens, limit):
        seen.append((tokens.tolist(), limit))
        if limit == 13:
            raise RuntimeError("the worker's tiers failed")
        return min(limit, 16 * (len(tokens) // 16))

    client = LookupClient(path, timeout=1.0)
    assert client.lookup(np.arange(40), 39) is None  # no worker yet
    server = LookupServer(path, lookup)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert client.lookup(np.arange(40), 39) == 32 and client.lookup(np.arange(5), 4) == 0
    assert seen[0] == (list(range(40)), 39)
    assert client.lookup(np.arange(40), 13) is None  # the worker's lookup raised: no answer
    assert client.lookup(np.arange(100), 99) == 96  # and it keeps serving
    server.close()
    assert client.lookup(np.arange(40), 39) is None
    restarted = LookupServer(path, lookup)  # a restarted worker: the client reconnects
    assert client.lookup(np.arange(70), 69) == 64
    client.close()
    restarted.close()
