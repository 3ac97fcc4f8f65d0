"""Tensor-parallel ranks in vLLM: the share of the model's KV heads each rank's worker holds (its
chunks are keyed as that shard: :func:`kdn.keys.shard_fingerprint`), and the scheduler's lookups asked
of every rank's worker (a hit is what all of them hold; a request's store has ended once each says so)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from kdn.engine import Prefix
from kdn.engine.channel import LookupClient
from kdn.engine.layout import ModelLayout
from kdn.engine.messages import MAX_ENDED, Readiness
from kdn.layout import layout_from_config


@dataclasses.dataclass(frozen=True)
class Rank:
    """One tensor-parallel rank of ``ranks``: ``heads``, ``(first, count)`` of the model's KV heads it
    holds, or None when it holds them all (one rank; an MLA latent, which every rank holds whole).
    Ranks holding the same heads (an MLA latent, heads vLLM replicates when there are more ranks than
    KV heads) key their chunks alike: each stores and loads the same chunks."""

    rank: int = 0
    ranks: int = 1
    heads: tuple | None = None

    @classmethod
    def of(cls, layout: ModelLayout, rank: int, ranks: int) -> Rank:
        """Rank ``rank``'s share as vLLM splits a model of ``layout`` over ``ranks`` (its
        ``QKVParallelLinear``: ``total // ranks`` heads each, or each head over ``ranks // total``
        ranks when there are fewer heads than ranks)."""
        if ranks == 1 or layout.latent:
            return cls(rank, ranks)
        total = layout.kv_heads
        if ranks >= total:
            return cls(rank, ranks, (rank // (ranks // total), 1))
        return cls(rank, ranks, (rank * (total // ranks), total // ranks))

    @classmethod
    def in_engine(cls, vllm_config, worker: bool) -> Rank:
        """This process' rank in a vLLM engine: a worker's own, or rank 0's for the scheduler (whose
        keys are rank 0's: its claims and the lookups of its own tiers)."""
        ranks = vllm_config.parallel_config.tensor_parallel_size
        if ranks == 1:
            return cls()
        rank = 0
        if worker:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        model = vllm_config.model_config
        return cls.of(layout_from_config(model.hf_config, model.dtype), rank, ranks)

    @property
    def keys_shared(self) -> bool:
        """Whether every rank keys a chunk as rank 0 does (so the chunks a scheduler's lookup found
        are every worker's to load without looking again)."""
        return self.heads is None


class RankLookups:
    """:class:`kdn.engine.channel.LookupClient`'s calls asked of every rank's worker (one
    socket each, ``paths`` by rank): each holds its own share in its own memory tier. A hit is the
    least any rank holds; no answer from one rank is no answer (the scheduler asks its own tiers)."""

    def __init__(self, paths: list[str]):
        self.clients = [LookupClient(path) for path in paths]
        self._ended: collections.OrderedDict = collections.OrderedDict()  # digest -> ranks that said so

    def lookup(self, tokens: np.ndarray, limit: int, scope: bytes | None = None) -> Prefix | None:
        """The least of what the ranks hold (:meth:`LookupClient.lookup` of each; raises
        :class:`kdn.engine.channel.WorkerNotServing` when one refused the engine)."""
        least = None
        for client in self.clients:
            found = client.lookup(tokens, limit, scope)
            if found is None:
                return None
            if least is None or found.tokens < least.tokens:
                least = found
        return least

    def readiness(self, keys: list[bytes]) -> Readiness | None:
        """Whether every rank's worker blends (:meth:`LookupClient.readiness`): the least of what they
        hold, the first refusal; None when one does not answer."""
        answers = [client.readiness(keys) for client in self.clients]
        if any(a is None for a in answers):
            return None
        refused = [a for a in answers if not a.blends]
        if refused:
            return refused[0]
        return Readiness(True, all(a.vouched for a in answers), min(a.held for a in answers))

    def take_ended(self) -> list[bytes]:
        """The requests whose store every rank has said has ended since the last call."""
        for rank, client in enumerate(self.clients):
            for digest in client.take_ended():
                self._ended.setdefault(digest, set()).add(rank)
        ended = [digest for digest, told in self._ended.items() if len(told) == len(self.clients)]
        for digest in ended:
            del self._ended[digest]
        while len(self._ended) > 2 * MAX_ENDED:  # a rank that never tells (it died): forget the oldest
            self._ended.popitem(last=False)
        return ended

    def close(self) -> None:
        for client in self.clients:
            client.close()
