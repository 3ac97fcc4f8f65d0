"""The request lifecycle under the engine (kdn.engine.requests), without any serving engine: a second
question waits for the first's prefill and is served its store exactly, a finished prefill holds
others only while its store may land, waits are bounded, an ephemeral request is loaded its hit and
holds no one, and claims in a shared store make one engine of two compute a document."""

import numpy as np
import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDNConfig
from kdn.engine import Engine, HFTarget
from kdn.engine.requests import Requests, request_digest
from kdn.layout import cache_to_kv_list, layout_of


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def served(engine, session, requests, req_id, ids, computed=0, store=True):
    """What a serving engine's lookup of ``ids`` gets: tokens kdn loads, or None (wait)."""
    tokens = session.tokens(ids)
    found = engine.find(session, tokens, len(tokens) - 1)
    return requests.lookup(session, req_id, tokens, None, found, computed, store=store)


def question(doc, seed: int, model, n: int = 20):
    return torch.cat([doc, random_ids(model, n, seed)], 1)


@pytest.fixture
def setup(stories):
    model, _ = stories
    engine = Engine(KDNConfig(chunk_size=64, verify_fraction=0), layout_of=layout_of)
    clock = Clock()
    return model, engine, engine.session(model), Requests(engine, "engine-a", clock=clock), clock


def test_a_second_question_waits_for_the_first_prefill_and_is_served_its_store_exactly(setup):
    model, engine, session, requests, clock = setup
    doc = random_ids(model, 300, seed=40)
    a, b = question(doc, 1, model), question(doc, 2, model)
    assert served(engine, session, requests, "a", a) == 0 and requests.admit("a", 0) is not None
    assert served(engine, session, requests, "b", b) is None  # a prefills the document: b waits
    requests.completing("a")
    requests.completed("a")  # its prefill ran; its store is on its way
    assert served(engine, session, requests, "b", b) is None  # still waits: the store has not landed
    kv = [t.detach() for t in cache_to_kv_list(full_prefill(model, a)[1])]
    assert engine.save(session, session.tokens(a), kv) == a.shape[1]
    requests.stores_ended([request_digest("a")])
    requests.finished("a")
    load = served(engine, session, requests, "b", b)
    assert load == 300  # the whole document (token-granular: its partial last chunk too); b's question computed
    record = requests.admit("b", load)
    got = engine.load(session, session.tokens(b), load, HFTarget("cpu"), found=record.found)
    truth = [t.detach() for t in cache_to_kv_list(full_prefill(model, b)[1])]
    assert got.hit == load and all(torch.equal(x, y[:, :, :load]) for x, y in zip(got.result, truth))


def test_a_finished_prefill_holds_others_only_while_its_store_may_land(setup):
    model, engine, session, requests, clock = setup
    doc = random_ids(model, 300, seed=41)
    a, b = question(doc, 3, model), question(doc, 4, model)
    served(engine, session, requests, "a", a)
    requests.admit("a", 0)
    requests.completing("a")
    requests.completed("a")
    requests.finished("a")  # its store never reports: it holds b at most store_grace
    clock.now += requests.store_grace - 1
    assert served(engine, session, requests, "b", b) is None
    clock.now += 2
    assert served(engine, session, requests, "b", b) == 0


def test_a_prefill_that_ended_before_completing_holds_no_one(setup):
    model, engine, session, requests, clock = setup
    doc = random_ids(model, 300, seed=42)
    served(engine, session, requests, "a", question(doc, 5, model))
    requests.admit("a", 0)
    requests.finished("a")  # aborted mid-prefill: nothing of it is on its way
    assert served(engine, session, requests, "b", question(doc, 6, model)) == 0


def test_a_wait_for_a_prefill_that_never_ends_is_bounded(setup):
    model, engine, session, requests, clock = setup
    counted = []
    requests.count = lambda **c: counted.append(c)
    doc = random_ids(model, 300, seed=43)
    served(engine, session, requests, "a", question(doc, 7, model))
    requests.admit("a", 0)
    b = question(doc, 8, model)
    assert served(engine, session, requests, "b", b) is None
    clock.now += requests.in_flight_wait - 1
    assert served(engine, session, requests, "b", b) is None
    clock.now += 2
    assert served(engine, session, requests, "b", b) == 0 and counted == [{"in_flight_waits": 1}]


def test_an_ephemeral_request_is_loaded_its_hit_and_holds_no_one(setup):
    model, engine, session, requests, clock = setup
    doc = random_ids(model, 300, seed=44)
    kv = [t.detach() for t in cache_to_kv_list(full_prefill(model, doc)[1])]
    engine.save(session, session.tokens(doc), kv)
    e = question(doc, 9, model, n=100)  # a hit of the document (300), and more than a chunk to compute
    load = served(engine, session, requests, "e", e, store=False)
    record = requests.admit("e", load)
    assert load == 300 and record.load == 300 and record.check is None and record.claims == []
    assert served(engine, session, requests, "f", question(doc, 9, model, n=120)) == 300  # e holds no one


def test_of_two_engines_sharing_a_store_one_computes_a_document_and_a_stalled_claim_ends_the_wait(
        stories, redis_server):
    model, _ = stories
    config = KDNConfig(chunk_size=64, remote_url=redis_server.url, verify_fraction=0, memory_bytes=1 << 26)
    engines = [Engine(config, layout_of=layout_of), Engine(config, layout_of=layout_of)]
    clock, counted = Clock(), []
    a, b = (Requests(e, owner, clock=clock) for e, owner in zip(engines, ("engine-a", "engine-b")))
    b.count = lambda **c: counted.append(c)
    b.lease, b.progress_leases = 0.5, 3
    doc = random_ids(model, 300, seed=45)
    sa, sb = (e.session(model) for e in engines)
    assert served(engines[0], sa, a, "a", question(doc, 10, model)) == 0 and a.get("a").claims
    a.admit("a", 0)
    q = question(doc, 11, model)
    assert served(engines[1], sb, b, "b", q) is None  # engine-a's live claim: b waits
    clock.now += 3 * 0.5 + 0.1  # nothing more of the document stored for progress_leases leases
    assert served(engines[1], sb, b, "b", q) == 0 and {"stalled_claims": 1} in counted
    assert np.array_equal(b.get("b").tokens, sb.tokens(q)) and b.get("b").claims == []
