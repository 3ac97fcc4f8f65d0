"""The admin endpoint (issue 85 item 2) over a real engine and real HTTP (a loopback port, a unix
socket): lookups agree with the engine's, a pin holds memory within the operator's bound, an evicted
document is a miss in a new engine while the other still reads back as a full prefill's KV, and bad
input, a missing token and an exposed port without one are refused by name."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request

import pytest
import torch

from conftest import full_prefill
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.admin import AdminServer

CHUNK = 32


def _ask(url: str, path: str, body=None, token: str | None = None) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=30) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture
def served(stories, tmp_path):
    """A writer over a disk folder holding two documents, and its admin endpoint."""
    model, _ = stories
    g = torch.Generator().manual_seed(11)
    docs = {name: torch.randint(3, 500, (1, 3 * CHUNK), generator=g) for name in ("a", "b")}
    writer = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv"), memory_bytes=1 << 24,
                           retain_fraction=0.5))
    for ids in docs.values():
        writer.store(model, ids, full_prefill(model, ids)[1])
    writer.flush()
    server = AdminServer(writer.engine, writer.session(model), "127.0.0.1:0")
    yield model, writer, docs, server
    server.close()


def test_lookup_pin_unpin_and_evict_act_on_the_store_and_a_new_engine_sees_them(served, tmp_path):
    model, writer, docs, server = served
    a, b = (docs[n][0].tolist() for n in ("a", "b"))
    assert _ask(server.url, "/v1/lookup", {"tokens": a}) == (200, {"tokens": writer.lookup(model, a, limit=len(a))})
    assert _ask(server.url, "/v1/lookup", {"tokens": a})[1]["tokens"] == 3 * CHUNK
    status, stats = _ask(server.url, "/v1/stats")
    assert status == 200 and stats["disk"]["entries"] == writer.stats()["disk"]["entries"] > 0

    assert _ask(server.url, "/v1/pin", {"tokens": a, "seconds": 60}) == (200, {"pinned_chunks": 3})
    assert writer.stats()["memory"]["pinned_bytes"] > 0
    status, refused = _ask(server.url, "/v1/pin", {"tokens": a * 400, "seconds": 60})  # over retain_fraction
    assert status == 400 and "retain_fraction" in refused["error"]
    assert _ask(server.url, "/v1/unpin", {"tokens": a}) == (200, {"unpinned_chunks": 3})
    assert writer.stats()["memory"]["pinned_bytes"] == 0

    assert _ask(server.url, "/v1/evict", {"tokens": b}) == (200, {"evicted_chunks": 3})
    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")))  # a new engine
    assert reader.lookup(model, b, limit=len(b)) == 0
    ids = docs["a"]
    kv, hit = reader.retrieve(model, torch.cat([ids, ids[:, :5]], 1))
    assert hit == 3 * CHUNK
    reference = full_prefill(model, ids)[1]
    for got, want in zip(kv.layers, reference.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def test_bad_requests_are_refused_by_name_and_the_engine_keeps_serving(served):
    model, writer, docs, server = served
    a = docs["a"][0].tolist()
    for path, body, words in (("/v1/lookup", {}, "'tokens'"), ("/v1/lookup", {"tokens": ["x"]}, "'tokens'"),
                              ("/v1/lookup", {"tokens": [10**9]}, "vocabulary"),
                              ("/v1/pin", {"tokens": a}, "seconds"),
                              ("/v1/pin", {"tokens": a, "seconds": -1}, "retain"),
                              ("/v1/evict", {"tokens": a, "first": -1}, "first"),
                              ("/v1/lookup", b"{not json", "Expecting"), ("/v1/lookup", b"[1]", "JSON object")):
        status, answer = _ask(server.url, path, body)
        assert status == 400 and words in answer["error"], (path, body, answer)
    assert _ask(server.url, "/v1/nothing", {"tokens": a})[0] == 404
    assert _ask(server.url, "/v1/lookup", {"tokens": a}) == (200, {"tokens": 3 * CHUNK})


def test_a_token_is_required_when_set_and_an_exposed_port_without_one_is_refused(served, tmp_path):
    model, writer, docs, _ = served
    session = writer.session(model)
    with pytest.raises(InvalidInputError, match="admin_token"):
        AdminServer(writer.engine, session, "0.0.0.0:0")
    server = AdminServer(writer.engine, session, "127.0.0.1:0", token="s3cret")
    try:
        assert _ask(server.url, "/v1/stats")[0] == 401
        assert _ask(server.url, "/v1/stats", token="wrong")[0] == 401
        assert _ask(server.url, "/v1/stats", token="s3cret")[0] == 200
    finally:
        server.close()
    path = str(tmp_path / "admin.sock")
    server = AdminServer(writer.engine, session, f"unix:{path}")
    try:
        connection = http.client.HTTPConnection("localhost")
        connection.sock = socket.socket(socket.AF_UNIX)
        connection.sock.connect(path)
        connection.request("POST", "/v1/lookup", json.dumps({"tokens": docs["a"][0].tolist()}))
        reply = connection.getresponse()
        assert reply.status == 200 and json.load(reply) == {"tokens": 3 * CHUNK}
    finally:
        server.close()


def test_kdn_warm_deposits_a_folder_and_pins_it_in_the_engine_that_serves_the_store(stories, tmp_path, capsys):
    """`kdn warm` against an engine reading the same disk folder: every document stored and pinned in
    that engine's memory (served from there exactly), a rerun deposits nothing again and pins again;
    an endpoint that is not there is one line and exit 2."""
    from kdn.cli import main

    model, tokenizer = stories
    folder = tmp_path / "docs"
    folder.mkdir()
    texts = {"a.txt": "Lily had a red ball. She liked to throw it high in the sky. " * 5,
             "b.txt": "Tom found a little dog in the park. The dog was sad and hungry. " * 5}
    for name, text in texts.items():
        (folder / name).write_text(text)
    store = str(tmp_path / "kv")
    serving = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=store, memory_bytes=1 << 24, retain_fraction=0.5))
    server = AdminServer(serving.engine, serving.session(model), "127.0.0.1:0")
    try:
        args = ["warm", str(folder), store, "--model", "stories260k", "--chunk-size", str(CHUNK),
                "--admin", server.url, "--seconds", "120"]
        assert main(args) == 0
        assert "2 documents pinned for 120 s" in capsys.readouterr().out
        pinned = serving.stats()["memory"]["pinned_entries"]
        chunks = sum(len(tokenizer(t)["input_ids"]) // CHUNK for t in texts.values())
        assert pinned == chunks > 0
        assert main(args) == 0 and "(2 already stored)" in capsys.readouterr().out
        for text in texts.values():
            ids = tokenizer(text, return_tensors="pt").input_ids
            kv, hit = serving.retrieve(model, ids)
            assert hit >= ids.shape[1] // CHUNK * CHUNK
            for got, want in zip(kv.layers, full_prefill(model, ids)[1].layers):  # as deposited: the whole text
                assert torch.equal(got.keys, want.keys[:, :, :hit]) and torch.equal(got.values, want.values[:, :, :hit])
        assert serving.stats()["memory"]["served"] >= chunks  # from the pinned memory, not the disk
    finally:
        server.close()
    assert main([*args[:-4], "--admin", "http://127.0.0.1:9", "--seconds", "60"]) == 2
    assert "admin endpoint" in capsys.readouterr().err


def test_kdn_pin_and_unpin_keep_a_prompt_in_the_running_engine_by_text_or_tokens(served, capsys):
    """`kdn pin` / `kdn unpin` through the endpoint: the prompt's chunks pinned in the serving engine's
    memory (by its text through the model's tokenizer, or its token ids), unpinned again; a prompt the
    engine does not hold is exit 1, a refused pin exit 2 with the endpoint's reason."""
    from kdn.cli import main

    model, writer, docs, server = served
    tokens = ",".join(map(str, docs["a"][0].tolist()))
    assert main(["pin", "--admin", server.url, "--tokens", tokens, "--seconds", "60", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"pinned_chunks": 3}
    assert writer.stats()["memory"]["pinned_entries"] == 3
    assert main(["unpin", "--admin", server.url, "--tokens", tokens]) == 0
    assert "3 chunks unpinned" in capsys.readouterr().out and writer.stats()["memory"]["pinned_bytes"] == 0
    assert main(["pin", "--admin", server.url, "--model", "stories260k", "--text", "Nobody stored this.",
                 "--seconds", "60"]) == 1
    assert main(["pin", "--admin", server.url, "--tokens", tokens, "--seconds", "-5"]) == 2
    assert "retain" in capsys.readouterr().err
