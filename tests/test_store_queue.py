"""A serving engine's store thread without any serving engine (issue 87 item 3): kdn.engine.StoreQueue
over a real engine and stories260K's KV, every outcome read back by a new engine on the same disk and
compared with a full prefill: a store lands exactly, an unstorable one is refused, a held-back span
that disagrees with the store drops the hit and stores nothing over it, a failing store and a refused
retention are counted, and every store's end is told (nobody waits for a store that cannot land)."""

from __future__ import annotations

import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDNConfig
from kdn.engine import Engine, HFTarget, StoreJob, StoreQueue
from kdn.engine.served import Served
from kdn.layout import cache_to_kv_list, layout_of

CHUNK = 32


@pytest.fixture
def stored(stories, tmp_path):
    """(model, a writer engine and its queue, the counts it reported, a reader factory, a prompt, its KV)."""
    model, _ = stories
    config = KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv"), memory_bytes=1 << 20, retain_fraction=0.01)
    writer, counts = Engine(config, layout_of=layout_of), []
    queue = StoreQueue(writer, lambda **c: counts.append(c))
    ids = random_ids(model, 3 * CHUNK + 5, seed=31)
    truth = [t.detach() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    yield model, writer, queue, counts, (lambda: Engine(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")),
                                                        layout_of=layout_of)), ids, truth
    queue.shutdown()


def _total(counts: list, name: str) -> float:
    return sum(c.get(name, 0) for c in counts)


def _served_by_a_new_engine(reader_of, model, ids) -> tuple[int, list]:
    reader = reader_of()
    session = reader.session(model)
    load = reader.load(session, session.tokens(ids), ids.shape[1] - 1, HFTarget("cpu"))
    return load.hit, load.result


def test_a_store_lands_exactly_and_its_end_is_told(stored):
    model, writer, queue, counts, reader_of, ids, truth = stored
    session = writer.session(model)
    queue.put(StoreJob("r1", session, session.tokens(ids), Served(), packed=truth))
    queue.drain()
    assert queue.ended() == ["r1"] and queue.ended() == []
    assert _total(counts, "stores") == 1 and _total(counts, "stored_tokens") == 3 * CHUNK
    hit, kv = _served_by_a_new_engine(reader_of, model, ids)
    assert hit == 3 * CHUNK  # the full chunks: a tail shorter than probe_step is not kept
    for got, want in zip(kv, truth):
        assert torch.equal(got, want[:, :, :hit])


def test_an_unstorable_store_is_refused_and_still_ends(stored):
    model, writer, queue, counts, reader_of, ids, truth = stored
    session = writer.session(model)
    queue.put(StoreJob("lossy", session, session.tokens(ids), Served(tokens=CHUNK, lossy=True), packed=truth))
    queue.skip("failed", session, session.tokens(ids), Served(tokens=CHUNK, failed=True))
    queue.drain()
    assert sorted(queue.ended()) == ["failed", "lossy"]
    assert _total(counts, "refused_stores") == 2 and _total(counts, "stores") == 0
    assert _served_by_a_new_engine(reader_of, model, ids)[0] == 0


def test_a_held_back_span_that_disagrees_drops_the_hit_and_nothing_is_stored_over_it(stored):
    model, writer, queue, counts, reader_of, ids, truth = stored
    session = writer.session(model)
    tokens = session.tokens(ids)
    writer.save(session, tokens[:2 * CHUNK], [t[:, :, :2 * CHUNK] for t in truth])
    check = (CHUNK, 2 * CHUNK)  # the rows the serving engine recomputed over the hit it was served
    honest = [t[:, :, CHUNK:] for t in truth]
    queue.put(StoreJob("honest", session, tokens, Served(tokens=2 * CHUNK), packed=truth, check=check,
                       first=CHUNK, kv=honest))
    queue.drain()
    assert _total(counts, "verify_checks") == 1 and _total(counts, "verify_mismatches") == 0
    assert _served_by_a_new_engine(reader_of, model, ids)[0] == 3 * CHUNK

    other = random_ids(model, 3 * CHUNK, seed=32)
    wrong = [t.clone() for t in cache_to_kv_list(full_prefill(model, other)[1])]
    writer.save(session, session.tokens(other)[:2 * CHUNK], [t[:, :, :2 * CHUNK] for t in wrong])
    computed = [t[:, :, CHUNK:] + 0.5 for t in wrong]  # what the model computed disagrees with the store
    queue.put(StoreJob("suspect", session, session.tokens(other), Served(tokens=2 * CHUNK), packed=wrong,
                       check=check, first=CHUNK, kv=computed))
    queue.drain()
    assert _total(counts, "verify_mismatches") == 1 and _total(counts, "refused_stores") == 1
    assert _served_by_a_new_engine(reader_of, model, other)[0] == 0  # the hit dropped, nothing stored over it
    assert sorted(queue.ended()) == ["honest", "suspect"]


def test_a_failing_store_and_a_refused_retention_are_counted_and_end(stored):
    model, writer, queue, counts, reader_of, ids, truth = stored
    session = writer.session(model)

    def broken():
        raise RuntimeError("the blocks were reused")

    from kdn.engine import Retention

    queue.put(StoreJob("broken", session, session.tokens(ids), Served(), packed=broken))
    queue.put(StoreJob("kept", session, session.tokens(ids), Served(), packed=truth,
                       retain=Retention(seconds=60)))  # over retain_fraction of memory: refused, counted
    queue.drain()
    assert sorted(queue.ended()) == ["broken", "kept"]
    assert _total(counts, "stores") == 1 and _total(counts, "refused_retentions") == 1
    assert writer.stats()["memory"]["pinned_bytes"] == 0
    assert _served_by_a_new_engine(reader_of, model, ids)[0] == 3 * CHUNK
