"""KV events: the blocks this engine holds, published over ZMQ in vLLM's format so that a
prefix-aware router (llm-d, Dynamo, docs/multi-node.md) can keep an index of them.

Wire format, as vLLM's `ZmqEventPublisher`: each message is three frames on a PUB socket bound
to `kv_events`: topic (empty), sequence number (8 bytes, big-endian, from 0), payload. The
payload is a msgpack `KVEventBatch`, msgspec's array-like layout with the class name as tag:

    [ts, [event, ...]]
    ["BlockStored", [hash], parent_hash | None, token_ids, block_size, lora_id (None), medium]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

The addition is the tier in `medium`: "hot", "cold" or "dropped" (kv/held.py), so a router can
prefer a replica that holds a prefix hot, or can at least replay it. A block moving between
tiers is stored again with its new medium (no removal first), so a router that ignores the
medium still sees a block present until it is removed from every tier. The first batch opens
with AllBlocksCleared (a fresh engine holds nothing).

After each step (and each abort) the engine diffs what it holds against what it last
published: a pass over the prefix cache's entries and the dropped records, only when on.
"""
from __future__ import annotations

import time

from kvreplay.kv.held import HeldBlock, held_blocks

SEND_QUEUE_MESSAGES = 100_000  # batches a slow subscriber may fall behind before ZMQ drops


def _import_transport():
    try:
        import msgpack
        import zmq
    except ImportError as exc:
        raise ValueError(f"kv_events needs pyzmq and msgpack ({exc.name} is missing): "
                         f"pip install 'kvreplay[serve]'") from exc
    return zmq, msgpack


class KVEventPublisher:
    """Binds the PUB socket at construction; `publish(engine)` sends what changed."""

    def __init__(self, endpoint: str, block_size: int):
        zmq, self._msgpack = _import_transport()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(f"kv_events={endpoint!r}: cannot bind ({exc}); pick a free port") from exc
        self.endpoint = endpoint
        self.block_size = block_size
        self.next_seq = 0     # the number of the next batch
        self._held: dict[int, HeldBlock] = {}
        self._cleared = False

    def publish(self, engine) -> None:
        live = {seq.seq_id: seq.token_ids for seq in [*engine.scheduler.running, *engine.scheduler.waiting,
                                                        *engine.sessions.sequences()]}
        held = held_blocks(engine.kv, live.get)
        events = self.diff(held)
        if events:
            payload = self._msgpack.packb([time.time(), events])
            self._socket.send_multipart([b"", self.next_seq.to_bytes(8, "big"), payload])
            self.next_seq += 1

    def diff(self, held: dict[int, HeldBlock]) -> list[list]:
        """The events that turn what was published into `held` (and remember it)."""
        events: list[list] = [] if self._cleared else [["AllBlocksCleared"]]
        self._cleared = True
        removed: dict[str, list[int]] = {}
        for block_hash, before in self._held.items():
            if block_hash not in held:
                removed.setdefault(before.tier, []).append(block_hash)
        events += [["BlockRemoved", hashes, tier] for tier, hashes in removed.items()]
        for block_hash, now in held.items():
            before = self._held.get(block_hash)
            if before is None or before.tier != now.tier:
                events.append(["BlockStored", [block_hash], now.parent, list(now.tokens),
                               self.block_size, None, now.tier])
        self._held = held
        return events

    def close(self) -> None:
        self._socket.close()
        self._context.term()
