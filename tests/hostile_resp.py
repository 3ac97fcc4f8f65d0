"""A fake Redis server on 127.0.0.1 that answers badly on purpose (tests of what a client survives).

It speaks enough RESP for kdn's clients (PING, CLIENT, SET, EXISTS, DEL, PTTL, GET, GETRANGE) and
holds values in a dict; ``mode`` says how it misbehaves on GET and GETRANGE:

* ``"honest"``: answers as Redis would;
* ``"trickle"``: sends the right reply one byte every ``delay`` seconds (EXISTS and SET too);
* ``"long-line"``: sends ``line_bytes`` bytes with no CRLF;
* ``"huge-bulk"``: announces a bulk string far longer than was asked, then sends its bytes;
* ``"extra-reply"``: sends every reply twice (the second is a reply nobody asked for).
"""

from __future__ import annotations

import socket
import threading
import time


def _bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


class HostileRedis:
    """One fake server; ``url`` for kdn, ``stop()`` when done (a context manager too)."""

    def __init__(self, mode: str = "honest", delay: float = 0.5, line_bytes: int = 64 << 20):
        self.mode, self.delay, self.line_bytes = mode, delay, line_bytes
        self.values: dict[bytes, bytes] = {}
        self.sent = 0  # bytes sent to clients, all connections
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                command = self._read_command(reader)
                if command is None:
                    return
                self._answer(conn, command)
        except OSError:
            return
        finally:
            conn.close()

    @staticmethod
    def _read_command(reader) -> list[bytes] | None:
        head = reader.readline()
        if not head.startswith(b"*"):
            return None
        args = []
        for _ in range(int(head[1:])):
            size = int(reader.readline()[1:])
            args.append(reader.read(size + 2)[:-2])
        return args

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def _trickle(self, conn: socket.socket, reply: bytes) -> None:
        for i in range(len(reply)):
            if self._stop.wait(self.delay):
                return
            self._send(conn, reply[i:i + 1])

    def _answer(self, conn: socket.socket, args: list[bytes]) -> None:
        name = args[0].upper()
        if name in (b"PING",):
            return self._send(conn, b"+PONG\r\n")
        if name in (b"CLIENT", b"SELECT", b"AUTH"):
            return self._send(conn, b"+OK\r\n")
        if name == b"SET":
            self.values[args[1]] = args[2]
            return self._trickle(conn, b"+OK\r\n") if self.mode == "trickle" else self._send(conn, b"+OK\r\n")
        if name in (b"EXISTS", b"DEL"):
            reply = b":%d\r\n" % sum(a in self.values for a in args[1:])
            return self._trickle(conn, reply) if self.mode == "trickle" else self._send(conn, reply)
        if name == b"PTTL":
            return self._send(conn, b":%d\r\n" % (-1 if args[1] in self.values else -2))
        if name not in (b"GET", b"GETRANGE"):
            return self._send(conn, b"-ERR unknown command\r\n")
        value = self.values.get(args[1])
        if name == b"GETRANGE":
            value = (value or b"")[int(args[2]):int(args[3]) + 1]
        reply = _bulk(value)
        if self.mode == "trickle":
            self._trickle(conn, reply)
        elif self.mode == "long-line":
            block = b"A" * (1 << 20)
            for _ in range(self.line_bytes >> 20):
                self._send(conn, block)
        elif self.mode == "huge-bulk":
            self._send(conn, b"$%d\r\n" % (1 << 30))
            block = b"B" * (1 << 20)
            for _ in range(64):
                self._send(conn, block)
        elif self.mode == "extra-reply":
            self._send(conn, reply)
            time.sleep(0.05)  # a separate segment: the client has read its reply by now
            self._send(conn, reply)
        else:
            self._send(conn, reply)
