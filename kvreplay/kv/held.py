"""Which block hashes a pool can serve a prefix from, and from which tier: what the KV events
publish (engine/kv_events.py) and what a router's index of this engine should hold.

    hot      the block sits in the prefix cache (referenced or in the LRU): a hit costs nothing
    cold     a live sequence holds it quantized in the cold pool
    dropped  a live sequence dropped its K/V but kept its keys in the key index: replayable

A hash held in several tiers counts in the best one (hot, then cold, then dropped). Blocks
evicted for good (no key kept) and blocks not yet hashed are not held.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class HeldBlock:
    tier: str
    parent: int | None           # the hash of the block before it (None: a sequence's first)
    tokens: tuple[int, ...]


def held_blocks(kv, tokens_of: Callable[[int], list[int] | None]) -> dict[int, HeldBlock]:
    """hash -> HeldBlock for every block `kv` (a KVManager) holds. `tokens_of(seq_id)`: the
    token ids of a live sequence (None for one the caller does not know: its blocks are left
    out), from which a cold or dropped block's tokens are read."""
    held: dict[int, HeldBlock] = {}
    for seq_id, records in kv.tiers.records.items():
        hashes = kv._hashes.get(seq_id, [])
        token_ids = tokens_of(seq_id)
        if token_ids is None:
            continue
        for index, record in records.items():
            if index >= len(hashes):  # a layered prefill's middle, hashed when it ends
                continue
            tier = "cold" if record.cold_slot is not None else "dropped" if record.slot is not None else None
            if tier is None or (hashes[index] in held and held[hashes[index]].tier == "cold"):
                continue
            tokens = tuple(token_ids[index * kv.block_size:(index + 1) * kv.block_size])
            held[hashes[index]] = HeldBlock(tier, hashes[index - 1] if index else None, tokens)
    for block_hash, parent, tokens in kv.pool.cache.entries():
        held[block_hash] = HeldBlock("hot", parent, tokens)
    return held
