"""Prefix-affine routing of requests to engine replicas, as a Ray Serve request router
(`ray.serve.request_router.RequestRouter`): Serve's own router runs it in the ingress for
every call of the engine deployment; nothing of ours sits between the handle and the replica.

A request's affinity key is a chain of hashes over the first blocks of its prompt text
(`prefix_hashes`: 64 characters a block, about one 16-token KV block of English), computed by
the ingress and passed as the call's first argument. The router remembers which replica each
hash was last sent to; a request goes to the replica holding the longest run of its first
hashes, unless that replica is busier than the least loaded one by more than `imbalance`
requests; otherwise (no match, or too busy) to the least loaded: fewest ongoing requests, then
waiting sequences, then KV usage (the replicas' `record_routing_stats`).
"""
from __future__ import annotations

import hashlib
import itertools
import json

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

CHARS_PER_BLOCK = 64
MAX_BLOCKS = 64          # longer prompts are keyed by their first 64 blocks
REMEMBERED_HASHES = 200_000  # the affinity table is cleared beyond this (a bound, not an LRU)


def prefix_hashes(body: bytes) -> list[int]:
    """The chained block hashes of a request body's prompt: a chat's messages (role and text) or
    a completion's prompt, in order; [] when the body has neither (no affinity)."""
    try:
        request = json.loads(body)
    except ValueError:
        return []
    if not isinstance(request, dict):
        return []
    if isinstance(request.get("messages"), list):
        text = "".join(f"{m.get('role')}\x1f{m.get('content')}\x1e" for m in request["messages"]
                       if isinstance(m, dict))
    elif isinstance(request.get("prompt"), (str, list)):
        text = json.dumps(request["prompt"])
    else:
        return []
    hashes, parent = [], b""
    for start in range(0, min(len(text) // CHARS_PER_BLOCK, MAX_BLOCKS) * CHARS_PER_BLOCK, CHARS_PER_BLOCK):
        parent = hashlib.blake2b(parent + text[start:start + CHARS_PER_BLOCK].encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "big"))
    return hashes


class PrefixAffinityRouter(RequestRouter):
    """Routing of the engine deployment (kvreplay/server/replicas.py); `routing` "prefix" or
    "round-robin" (the benchmark's baseline)."""

    def initialize_state(self, routing: str = "prefix", imbalance: int = 4, **kwargs):
        self.routing = routing
        self.imbalance = imbalance
        self.owner: dict[int, ReplicaID] = {}  # block hash -> the replica last sent it
        self.new_prefixes: dict[ReplicaID, int] = {}  # prefixes sent with no owner, per replica
        self._turns = itertools.count()

    def _load(self, replica: RunningReplica) -> tuple:
        """Ongoing requests (Serve's count) and waiting sequences, then KV usage in tenths (the
        replica's stats, refreshed every second), then the new prefixes it was given: a tie
        spreads new conversations evenly."""
        ongoing = self.replica_queue_len_cache.get(replica.replica_id) or 0
        stats = replica.routing_stats or {}
        return (ongoing + stats.get("waiting", 0), round(stats.get("kv_usage", 0.0), 1),
                self.new_prefixes.get(replica.replica_id, 0))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if self.routing == "round-robin":
            first = next(self._turns) % len(ordered)
            return [[replica] for replica in ordered[first:] + ordered[:first]]
        by_load = sorted(ordered, key=self._load)
        hashes = _hashes_of(pending_request)
        owner = self._owner_of(hashes, {r.replica_id: r for r in ordered})
        if owner is not None and self._load(owner)[0] <= self._load(by_load[0])[0] + self.imbalance:
            ranked = [owner] + [r for r in by_load if r is not owner]
        else:
            ranked = by_load
        self._remember(hashes, ranked[0].replica_id, new=owner is None)
        return [[replica] for replica in ranked]

    def _owner_of(self, hashes: list[int], replicas: dict) -> RunningReplica | None:
        for block_hash in reversed(hashes):  # the longest shared prefix first
            owner = replicas.get(self.owner.get(block_hash))
            if owner is not None:
                return owner
        return None

    def _remember(self, hashes: list[int], replica_id: ReplicaID, new: bool) -> None:
        """`replica_id` now holds `hashes` (recorded at the choice: Serve calls
        on_request_routed only under its rejection protocol). A retry after a rejection
        chooses again and overwrites this."""
        if hashes and new:
            self.new_prefixes[replica_id] = self.new_prefixes.get(replica_id, 0) + 1
        if len(self.owner) + len(hashes) > REMEMBERED_HASHES:
            self.owner.clear()
        for block_hash in hashes:
            self.owner[block_hash] = replica_id


def _hashes_of(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    first = pending_request.args[0]
    return first if isinstance(first, list) else []
