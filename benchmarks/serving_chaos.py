"""Chaos for bench_serving.py's kdn-redis runs: the shared redis-server misbehaves while clients are served.

A schedule, in seconds from the run's start (``--chaos plant@5,stop@10+30,restart@55``):

* ``plant@T``: 8-byte manifest heads and 42 bytes of garbage written under live chunk names (every
  eighth value the store holds), and a forged claim with no TTL under every chunk name (a claim kdn
  would never write);
* ``stop@T+D``: the server SIGSTOPped for D seconds (connections hang: every call runs into its
  deadline), then SIGCONTed;
* ``restart@T``: the server SIGKILLed and started again on its port, empty.

Each event's start and end are recorded; after a restart, when the store holds a value again (the
engines stored through it: their breakers closed) is recorded too. :func:`judge` turns the records
of a chaos run and of vLLM alone on the same prompts into the issue's targets.
"""

from __future__ import annotations

import os
import signal
import threading
import time

MANIFEST_HEAD = b"KDNM\0\0\0\0"


def parse(schedule: str) -> list[tuple[str, float, float]]:
    """``"plant@5,stop@10+30,restart@55"`` -> [("plant", 5, 0), ("stop", 10, 30), ("restart", 55, 0)]."""
    events = []
    for item in filter(None, (s.strip() for s in schedule.split(","))):
        name, _, when = item.partition("@")
        at, _, length = when.partition("+")
        if name not in ("plant", "stop", "restart") or not at:
            raise ValueError(f"chaos event {item!r}: expected plant@T, stop@T+D or restart@T")
        events.append((name, float(at), float(length or 0)))
    return sorted(events, key=lambda e: e[1])


class Chaos:
    """Runs ``events`` against ``redis`` (a tests/redis_servers.RedisServer) from :meth:`start`."""

    def __init__(self, redis, events: list):
        self.redis, self.events, self.log = redis, events, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> None:
        self.t0, self.epoch0 = time.monotonic(), time.time()
        self._thread.start()

    def finish(self) -> list[dict]:
        """Stop (a stopped server is resumed, a killed one is up) and return the event log."""
        self._stop.set()
        self._thread.join()
        return self.log

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _run(self) -> None:
        for name, at, length in self.events:
            if self._stop.wait(max(0.0, at - self._now())):
                return
            record = {"event": name, "start": self._now()}
            if name == "plant":
                record.update(self._plant())
            elif name == "stop":
                os.kill(self.redis.proc.pid, signal.SIGSTOP)
                self._stop.wait(length)
                os.kill(self.redis.proc.pid, signal.SIGCONT)
            else:
                self.redis.stop()
                self.redis.start()
                record["end"] = self._now()
                self.log.append(record)
                record["stored_again"] = self._until_stored()
                continue
            record["end"] = self._now()
            self.log.append(record)

    def _plant(self) -> dict:
        import redis as redis_py

        client = redis_py.Redis(port=self.redis.port)
        names = sorted(n.decode() for n in client.scan_iter(match="kdn:*:{*}", count=1000) if b":p" not in n)
        bad = names[::8]
        pipe = client.pipeline(transaction=False)
        for i, name in enumerate(bad):
            pipe.set(name, MANIFEST_HEAD if i % 2 == 0 else b"g" * 42)
        for name in names:  # a forged claim on every chunk, forever
            fmt, key = name.split(":")[1], name[name.index("{") + 1:name.index("}")]
            pipe.set(f"kdn:{fmt}:claim:{key}", b"intruder")
        pipe.execute()
        return {"planted_values": len(bad), "forged_claims": len(names)}

    def _until_stored(self) -> float | None:
        """Seconds after the restart until the store holds a kdn value again (None: not before the end)."""
        import redis as redis_py

        client, start = redis_py.Redis(port=self.redis.port), self._now()
        while not self._stop.wait(0.2):
            if any(True for _ in client.scan_iter(match="kdn:*:{*}", count=100)):
                return self._now() - start
        return None


def judge(kdn_records: list, alone_records: list, chaos_log: list, remote_timeout: float) -> dict:
    """The targets of a chaos run against vLLM alone on the same prompts (records in prompt order):
    the longest TTFT against 2x a miss's (vLLM alone's median) + ``remote_timeout``; throughput while
    the server was stopped against vLLM alone's; replies that differ."""
    import statistics

    done = [r for r in kdn_records if "error" not in r]
    alone = [r for r in alone_records if "error" not in r]
    miss_ttft = statistics.median(r["ttft"] for r in alone)
    bound = 2 * miss_ttft + remote_timeout
    over = [r["ttft"] for r in done if r["ttft"] > bound]
    alone_rps = len(alone) / (max(r["start"] + r["latency"] for r in alone) - min(r["start"] for r in alone))
    out = {"miss_ttft_s": miss_ttft, "ttft_bound_s": bound, "max_ttft_s": max(r["ttft"] for r in done),
           "over_bound": len(over), "errors": len(kdn_records) - len(done), "vllm_alone_rps": alone_rps,
           "replies_compared": sum(1 for a, b in zip(kdn_records, alone_records) if "reply" in a and "reply" in b),
           "replies_differ": sum(1 for a, b in zip(kdn_records, alone_records)
                                 if "reply" in a and "reply" in b and a["reply"] != b["reply"])}
    for event in chaos_log:
        if event["event"] == "stop":
            start, end = event["start"], event["end"]
            finished = [r for r in done if start <= r["start"] + r["latency"] <= end]
            out["outage_s"] = end - start
            out["outage_requests_done"] = len(finished)
            out["outage_rps"] = len(finished) / (end - start)
            out["outage_vs_alone"] = out["outage_rps"] / alone_rps
        if event["event"] == "restart":
            out["stored_again_after_restart_s"] = event.get("stored_again")
    return out
