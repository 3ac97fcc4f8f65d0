"""An admin endpoint over a running engine: what its tiers hold, and a stored prompt looked up, pinned,
unpinned or evicted by its token ids, as JSON over HTTP on a loopback port or a unix socket, so a fleet's
control plane acts on a node without a shell there (the vLLM connector starts one with
``kv_connector_extra_config={"admin": ...}``).

Routes (every body and answer a JSON object; ``tokens`` a prompt's token ids, as the model's tokenizer
gives them; the engine's tenant only):

* ``GET /v1/stats``: the engine's counters per tier (:meth:`kdn.engine.Engine.stats`);
* ``POST /v1/lookup {"tokens"}``: ``{"tokens": n}``, the leading tokens a request of them is served;
* ``POST /v1/pin {"tokens", "seconds"}``: the prompt's stored chunks pinned in memory that long, within
  the operator's bounds (``retain_fraction``, ``retain_max_seconds``): ``{"pinned_chunks": n}``;
* ``POST /v1/unpin {"tokens"}``: ``{"unpinned_chunks": n}``;
* ``POST /v1/evict {"tokens", "first": 0}``: the prompt's chunks from chunk ``first`` on removed from
  every tier (a shared prefix is kept with ``first``): ``{"evicted_chunks": n}``.

Bad input is a 400 with ``{"error": ...}``; with a ``token``, a request without
``Authorization: Bearer <token>`` is a 401. A port on another address than loopback needs a token.

Example:
    >>> import json, urllib.request
    >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
    >>> out = cache.generate(model, ids, max_new_tokens=1)          # the document stored
    >>> server = AdminServer(cache.engine, cache.session(model), "127.0.0.1:0")
    >>> ask = lambda path, body: json.load(urllib.request.urlopen(urllib.request.Request(
    ...     server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})))
    >>> tokens = ids[0].tolist()
    >>> ask("/v1/lookup", {"tokens": tokens})["tokens"] == len(tokens) // 16 * 16
    True
    >>> ask("/v1/evict", {"tokens": tokens})["evicted_chunks"] == len(tokens) // 16
    True
    >>> ask("/v1/lookup", {"tokens": tokens})
    {'tokens': 0}
    >>> server.close()
"""

from __future__ import annotations

import hmac
import http.server
import ipaddress
import json
import logging
import os
import socketserver
import threading

import numpy as np

from kdn._core import InvalidInputError, KDNError
from kdn.engine.retention import Retention

log = logging.getLogger("kdn")
MAX_BODY = 64 << 20  # bytes of a request's JSON: a million-token prompt's ids fit


class AdminServer:
    """The admin endpoint of ``engine`` for the model of ``session``, on ``address``:
    ``"host:port"`` (port 0: a free one; :attr:`url` says which) or ``"unix:/path"`` (the socket made
    readable by its owner only). ``token``: the bearer token every request must carry (required for a
    host that is not loopback). Serves from a thread of its own until :meth:`close`."""

    def __init__(self, engine, session, address: str, token: str | None = None):
        if not isinstance(address, str) or not address:
            raise InvalidInputError(f"admin: an address 'host:port' or 'unix:/path', got {address!r}")
        self.engine, self.session, self.token = engine, session, token or None
        handler = _handler(self)
        if address.startswith("unix:"):
            path = address[len("unix:"):]
            if os.path.exists(path):
                os.unlink(path)
            self._server = _UnixServer(path, handler)
            os.chmod(path, 0o600)
            self.url = f"unix:{path}"
        else:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidInputError(f"admin: an address 'host:port' or 'unix:/path', got {address!r}")
            if not _loopback(host) and self.token is None:
                raise InvalidInputError(f"admin: {host} is not a loopback address: give admin_token (a bearer "
                                        "token every request must carry) to listen there")
            self._server = http.server.ThreadingHTTPServer((host, int(port)), handler)
            self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="kdn-admin", daemon=True)
        self._thread.start()

    def answer(self, method: str, path: str, body: dict) -> dict:
        """The answer to one request (InvalidInputError: a 400; KeyError: a 404)."""
        if (method, path) == ("GET", "/v1/stats"):
            return self.engine.stats()
        if method != "POST" or path not in ("/v1/lookup", "/v1/pin", "/v1/unpin", "/v1/evict"):
            raise KeyError(path)
        tokens = _tokens(body, self.session)
        engine, session = self.engine, self.session
        if path == "/v1/lookup":
            return {"tokens": int(engine.find(session, tokens, len(tokens)).tokens)}
        if path == "/v1/pin":
            retention = Retention.asked(body.get("seconds"))
            if retention.seconds is None:
                raise InvalidInputError("pin: 'seconds', a positive number, is required")
            return {"pinned_chunks": int(engine.retain(session, tokens, retention))}
        if path == "/v1/unpin":
            return {"unpinned_chunks": int(engine.unpin(session.prefix_keys(tokens)))}
        first = body.get("first", 0)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise InvalidInputError(f"evict: 'first', a chunk index >= 0, got {first!r:.40}")
        return {"evicted_chunks": int(engine.evict(session, tokens, first))}

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self.url.startswith("unix:") and os.path.exists(self.url[len("unix:"):]):
            os.unlink(self.url[len("unix:"):])


def ask(url: str, path: str, body: dict | None = None, token: str | None = None, timeout: float = 60.0) -> dict:
    """One request to an admin endpoint at ``url`` (``http://host:port`` or ``unix:/path``): its JSON
    answer; a refusal (400, 401, 404) or an unreachable endpoint raises InvalidInputError saying why."""
    import http.client
    import socket
    import urllib.parse

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    try:
        if url.startswith("unix:"):
            connection = http.client.HTTPConnection("localhost", timeout=timeout)
            connection.sock = socket.socket(socket.AF_UNIX)
            connection.sock.settimeout(timeout)
            connection.sock.connect(url[len("unix:"):])
        else:
            where = urllib.parse.urlsplit(url)
            if where.scheme != "http" or not where.hostname:
                raise InvalidInputError(f"admin: an endpoint http://host:port or unix:/path, got {url!r}")
            connection = http.client.HTTPConnection(where.hostname, where.port or 80, timeout=timeout)
        connection.request("POST" if data is not None else "GET", path, data, headers)
        reply = connection.getresponse()
        answer = json.loads(reply.read() or b"{}")
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"admin endpoint {url}: {type(e).__name__}: {e}") from None
    if reply.status != 200:
        raise InvalidInputError(f"admin endpoint {url}{path}: {reply.status}: {answer.get('error', answer)}")
    return answer


def _tokens(body: dict, session) -> np.ndarray:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in tokens):
        raise InvalidInputError("'tokens': a non-empty list of token ids is required")
    return session.tokens(tokens)  # ids outside the model's vocabulary: InvalidInputError


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        request, _ = super().get_request()
        return request, ("unix", 0)  # BaseHTTPRequestHandler formats a client address


def _handler(admin: AdminServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            log.debug("kdn admin: " + format, *args)

        def _reply(self, status: int, answer: dict) -> None:
            data = json.dumps(answer, default=str).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            if not admin.authorized(self.headers.get("Authorization")):
                return self._reply(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"})
            try:
                size = int(self.headers.get("Content-Length") or 0)
                if not 0 <= size <= MAX_BODY:
                    raise InvalidInputError(f"a body of at most {MAX_BODY} bytes, got {size}")
                body = json.loads(self.rfile.read(size) or b"{}") if method == "POST" else {}
                if not isinstance(body, dict):
                    raise InvalidInputError("the body is a JSON object")
                self._reply(200, admin.answer(method, self.path, body))
            except KeyError:
                self._reply(404, {"error": f"no route {method} {self.path} (GET /v1/stats; POST /v1/lookup, "
                                           "/v1/pin, /v1/unpin, /v1/evict)"})
            except (InvalidInputError, ValueError) as e:  # ValueError: a body that is not JSON
                self._reply(400, {"error": str(e)})
            except KDNError as e:
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

        def do_GET(self):  # noqa: N802 - http.server's name
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

    return Handler


__all__ = ["AdminServer", "ask"]
