"""Remote store URLs: credential redaction for logs, errors and stats (the schemes are the
transports', :mod:`kdn.storage.transport`)."""

from __future__ import annotations

import urllib.parse

_SECRET_PARAMS = {"password", "pass", "pwd", "auth", "token", "secret"}


def redact(url: str) -> str:
    """``url`` without any credential, for logs, errors, ``repr`` and ``stats()``: the password of
    ``user:password@`` (or ``:password@``) and the values of query parameters such as ``?password=``
    (redis-py's form for unix sockets)."""
    try:
        parts = urllib.parse.urlsplit(str(url))
    except ValueError:
        return "<unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = (f"{user}:***" if ":" in userinfo else "***" if not user else user) + "@" + host
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}={'***' if k.lower() in _SECRET_PARAMS else v}" for k, v in pairs)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
