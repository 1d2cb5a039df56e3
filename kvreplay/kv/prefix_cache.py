"""Prefix cache: full blocks are indexed by a hash that chains over everything before them.

    block 0: h0 = H(None, tokens[0:16],  extra)
    block 1: h1 = H(h0,   tokens[16:32], extra)
    block 2: h2 = H(h1,   tokens[32:48], extra)     equal h2 => equal 48-token prefix (modulo collisions)

A hash match alone is not trusted: the cached block's tokens are compared too, so a collision is
a miss (counted in `collisions`), never wrong K/V. Blocks are registered once their tokens' K/V are
all computed; a block keeps its hash while it sits unreferenced in the pool's LRU list, and loses
it when the pool hands it out for new content.
"""
from __future__ import annotations

from typing import Callable

HashFn = Callable[[int | None, tuple[int, ...], tuple], int]


def chain_hash(parent: int | None, tokens: tuple[int, ...], extra_keys: tuple = ()) -> int:
    """Hash of one full block given its parent block's hash. Python's hash of a tuple of ints
    is deterministic across runs (no string salting is involved); the first block's missing
    parent is a constant, not None (whose hash is its address before Python 3.12), so the
    session tier's files keep their names across restarts."""
    return hash((_ROOT if parent is None else parent, tokens, extra_keys))


_ROOT = 0x6B767265706C6179  # "kvreplay": the parent of a sequence's first block


class PrefixCache:
    """hash -> block for full, computed blocks; and block -> (hash, tokens) for the re-check."""

    def __init__(self):
        self._block_by_hash: dict[int, int] = {}
        self._key_by_block: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._parent_by_hash: dict[int, int | None] = {}  # for KV events (engine/kv_events.py)
        self._unlisted: set[int] = set()  # hashes of a hybrid pool's local pages (kv/local_groups.py)
        self.queries = 0      # blocks looked up
        self.hits = 0         # blocks found with matching tokens
        self.collisions = 0   # hash found, tokens differ

    def __len__(self) -> int:
        return len(self._key_by_block)

    def lookup(self, block_hash: int, tokens: tuple[int, ...], count: bool = True) -> int | None:
        """The block cached under `block_hash` holding `tokens`; `count`: in the hit counters."""
        self.queries += count
        block = self._block_by_hash.get(block_hash)
        if block is None:
            return None
        if self._key_by_block[block][1] != tokens:
            self.collisions += count
            return None
        self.hits += count
        return block

    def insert(self, block: int, block_hash: int, tokens: tuple[int, ...],
               parent: int | None = None, listed: bool = True) -> bool:
        """Index `block` (`parent`: the hash of the block before it, None for a first block;
        `listed`: among `entries`, the blocks the engine reports it holds).
        False when the hash is already taken (same content computed twice, or a collision): the
        first block keeps the entry, this one stays unindexed."""
        assert block not in self._key_by_block, f"block {block} is already cached"
        if block_hash in self._block_by_hash:
            return False
        self._block_by_hash[block_hash] = block
        self._key_by_block[block] = (block_hash, tokens)
        self._parent_by_hash[block_hash] = parent
        if not listed:
            self._unlisted.add(block_hash)
        return True

    def forget(self, block: int) -> None:
        key = self._key_by_block.pop(block, None)
        if key is not None:
            del self._block_by_hash[key[0]]
            del self._parent_by_hash[key[0]]
            self._unlisted.discard(key[0])

    def entries(self):
        """(hash, parent hash, tokens) of every cached block (listed ones)."""
        for block_hash, tokens in self._key_by_block.values():
            if block_hash not in self._unlisted:
                yield block_hash, self._parent_by_hash[block_hash], tokens

    def is_listed(self, block: int) -> bool:
        """Cached, and among `entries` (not a hybrid pool's local page)."""
        key = self._key_by_block.get(block)
        return key is not None and key[0] not in self._unlisted

    def is_cached(self, block: int) -> bool:
        return block in self._key_by_block

    def key(self, block: int) -> tuple[int, tuple[int, ...]] | None:
        return self._key_by_block.get(block)

    def check_integrity(self, block_size: int) -> None:
        assert len(self._block_by_hash) == len(self._key_by_block), "hash index and block keys differ"
        assert self._parent_by_hash.keys() == self._block_by_hash.keys(), "parent hashes and hash index differ"
        assert self._unlisted <= self._block_by_hash.keys(), "unlisted hash not indexed"
        for block, (block_hash, tokens) in self._key_by_block.items():
            assert self._block_by_hash.get(block_hash) == block, f"block {block}: hash not indexed"
            assert len(tokens) == block_size, f"block {block}: cached with {len(tokens)} tokens"
