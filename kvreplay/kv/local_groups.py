"""The hybrid pool's local layer groups, owned by the KV manager (docs/architecture.md, "Gemma 3").

A sliding-window model's local layers read only their last `window` positions, so they keep K/V
only for the blocks that window touches. The pool is one set of pages, each holding one block
(`block_size` tokens) for `S` layers, S the number of global layers; the global layers form the
table every other part of the engine knows (`KVManager._tables`), and the local layers are cut
into K groups of S (the last one padded), each with its own table per sequence:

    column (table index)  0    1    2   ...  f-1 |  f   ... n-1      f = first column the next
    global table          g0   g1   g2  ...  .   |  .   ... .        query's window touches
    local group i         --   --   --  ...  --  |  lf  ... ln-1     (-- released: DROPPED)

One budget covers both: a column costs 1 + K pages while in the window, 1 after. Pages of a
layer position s (storage tensor s) serve global layer s and the s-th layer of every local
group, through the table of the layer's group. Local pages of full, computed blocks are cached
in the pool's prefix cache under a hash derived from the block's chain hash and the group (not
listed as blocks the engine holds), so a released page waits in the LRU like any cached block.

Prefix hits: a hit counts as far as every local group still has the pages the next query's
window reads (the blocks before the hit's end within the window); a shorter hit is taken when
they were evicted. Pauses keep the pinned head only when the local pages its end needs are held.
"""
from __future__ import annotations

from kvreplay.kv.tiers import DROPPED, blocks_for

_LOCAL_TAG = 0x6C6F63616C  # "local": enters the hash of a local page with its group


def layer_layout(num_layers: int, local_layers: tuple[int, ...]) -> tuple[list[int], list[int | None], int]:
    """(storage slot of each layer, its local group or None for a global layer, local groups)."""
    if not local_layers:
        return list(range(num_layers)), None, 0
    global_layers = [layer for layer in range(num_layers) if layer not in local_layers]
    slots_per_page = len(global_layers)
    assert slots_per_page, "a hybrid pool needs at least one global layer"
    slot, group = [0] * num_layers, [None] * num_layers
    for position, layer in enumerate(global_layers):
        slot[layer] = position
    for position, layer in enumerate(sorted(local_layers)):
        group[layer], slot[layer] = divmod(position, slots_per_page)
    return slot, group, blocks_for(len(local_layers), slots_per_page)


def local_hash(block_hash: int, group: int) -> int:
    return hash((block_hash, _LOCAL_TAG, group))


class LocalGroups:
    def __init__(self, kv, num_groups: int, window_tokens: int):
        self.kv = kv  # the KVManager that owns this helper, the pool and the global tables
        self.num_groups = num_groups
        self.window_tokens = window_tokens
        self.block_size = kv.block_size
        # Blocks one window touches at most: what a sequence holds per group between steps.
        self.window_blocks = blocks_for(window_tokens, self.block_size) + 1 if num_groups else 0
        self.tables: dict[int, list[list[int]]] = {}  # seq -> group -> column -> page or DROPPED
        # The model layers the global table serves, in order (storage slot i: the i-th); None
        # when the pool is not hybrid (every layer).
        self.global_layers: tuple[int, ...] | None = tuple(
            layer for layer, group in enumerate(kv.layer_groups) if group is None) if num_groups else None

    def first_needed(self, num_tokens: int) -> int:
        """First column the query at position `num_tokens` reads (its window's first block)."""
        if not self.num_groups:
            return 0
        return max(0, num_tokens - self.window_tokens + 1) // self.block_size

    def group_table(self, seq_id: int, group: int) -> list[int]:
        """The group's table of `seq_id` with released columns as page 0 (never read: every
        query's window starts at or after the first held column)."""
        table = self.tables[seq_id][group]
        first = len(table) - self._held_in(table)
        return [0] * first + table[first:]

    @staticmethod
    def _held_in(table: list[int]) -> int:
        held = 0
        while held < len(table) and table[-1 - held] != DROPPED:  # held columns are a suffix
            held += 1
        return held

    def num_held(self, seq_id: int) -> int:
        """Columns whose local pages `seq_id` holds (the same in every group)."""
        tables = self.tables.get(seq_id)
        return self._held_in(tables[0]) if tables else 0

    # ------------------------------------------------------------------ queries
    def num_blocks_projected(self, seq_id: int, num_new_tokens: int) -> int:
        """Blocks `seq_id` holds more once `num_new_tokens` more are computed: the local groups
        only their window (`KVManager.num_blocks_needed` counts a step's whole chunk)."""
        kv = self.kv
        if not self.num_groups:
            return kv.num_blocks_needed(seq_id, num_new_tokens)
        total = kv.num_slots(seq_id) + num_new_tokens
        new = max(0, blocks_for(total, self.block_size) - len(kv._tables.get(seq_id, ())))
        return new + self.num_pages_projected(seq_id, total)

    def num_pages_needed(self, seq_id: int, new_columns: int, copy: bool) -> int:
        return self.num_groups * (new_columns + copy)

    def num_pages_projected(self, seq_id: int, num_tokens: int) -> int:
        """More local pages `seq_id` holds once it has `num_tokens` tokens, between steps."""
        held = self.num_held(seq_id) * self.num_groups
        return max(0, self.num_groups * min(blocks_for(num_tokens, self.block_size), self.window_blocks) - held)

    def num_released_by(self, seq_id: int, keep: int) -> int:
        """Local pages that cutting `seq_id` to `keep` columns frees (the last reference)."""
        pool = self.kv.pool
        return sum(1 for table in self.tables.get(seq_id, ()) for page in table[keep:]
                   if page != DROPPED and pool.ref_counts[page] == 1)

    def head_is_whole(self, seq_id: int, keep: int, num_tokens: int) -> bool:
        """The pages the query after `num_tokens` tokens (kept in `keep` columns) reads are held."""
        tables = self.tables.get(seq_id)
        return not tables or all(page != DROPPED for table in tables
                                 for page in table[self.first_needed(num_tokens):keep])

    def trim_hit(self, seq_id: int, start_column: int, hashes: list[int], tokens: list[tuple]) -> int:
        """How many of the hit blocks (hashes, tokens: columns start_column ..) to take: the most
        for which every group has the pages the next query's window reads."""
        if not self.num_groups:
            return len(hashes)
        cache = self.kv.pool.cache
        own = self.tables.get(seq_id)

        def present(column: int) -> bool:
            if column < start_column:
                return all(table[column] != DROPPED for table in own)
            index = column - start_column
            return all(cache.lookup(local_hash(hashes[index], group), tokens[index], count=False) is not None
                       for group in range(self.num_groups))

        end = start_column + len(hashes)
        while end > start_column:
            missing = next((c for c in range(end - 1, self.first_needed(end * self.block_size) - 1, -1)
                            if not present(c)), None)
            if missing is None:
                break
            end = missing  # any longer hit's window still reads the missing column
        return max(0, end - start_column)

    def blocks_by_group(self) -> dict[str, dict[str, int]]:
        """Pool blocks (pages) per layer group: `used` (referenced by a table; the key index's
        reserved blocks aside) and `cached` (free, in the LRU). One group, `global`, when the
        pool is not hybrid: every layer keeps every block."""
        kv = self.kv
        local_used = len({page for tables in self.tables.values() for table in tables
                          for page in table if page != DROPPED})
        local_cached = sum(not kv.pool.cache.is_listed(page) for page in kv.pool.lru_order())
        groups = {"global": {"used": kv.num_used_blocks - kv.num_reserved_blocks - local_used,
                             "cached": kv.num_cached_blocks - local_cached}}
        if self.num_groups:
            groups["local"] = {"used": local_used, "cached": local_cached}
        return groups

    # ------------------------------------------------------------------ mutations
    def add(self, seq_id: int) -> None:
        self.tables[seq_id] = [[] for _ in range(self.num_groups)]

    def fork(self, parent_id: int, child_id: int) -> None:
        self.tables[child_id] = [list(table) for table in self.tables[parent_id]]
        for table in self.tables[child_id]:
            for page in table:
                if page != DROPPED:
                    self.kv.pool.acquire(page)

    def grow(self, seq_id: int, num_columns: int) -> None:
        """New pages for the columns up to `num_columns` (the caller checked the room)."""
        for table in self.tables[seq_id]:
            while len(table) < num_columns:
                table.append(self.kv.pool.take())

    def copy_page(self, source: int, copy: int) -> None:
        """Page `source`'s rows into page `copy`, in every storage tensor."""
        for storage in self.kv.storages:  # [2, Hkv, num_blocks, block_size, D]
            storage[:, :, copy] = storage[:, :, source]

    def copy_last(self, seq_id: int) -> None:
        """The first write into a shared partial last block: each group's page copied."""
        for table in self.tables[seq_id]:
            if self.kv.pool.ref_counts[table[-1]] > 1:
                source, table[-1] = table[-1], self.kv.pool.take()
                self.copy_page(source, table[-1])
                self.kv.pool.release(source)

    def adopt(self, seq_id: int, start_column: int, hashes: list[int], tokens: list[tuple],
              num_tokens: int) -> None:
        """Columns from `start_column` found by `trim_hit`: the pages the window at
        `num_tokens` reads are taken from the cache, the others stay released."""
        first = self.first_needed(num_tokens)
        for group, table in enumerate(self.tables[seq_id]):
            for index, (block_hash, block_tokens) in enumerate(zip(hashes, tokens)):
                page = DROPPED
                if start_column + index >= first:
                    page = self.kv.pool.cache.lookup(local_hash(block_hash, group), block_tokens, count=False)
                    assert page is not None, f"seq {seq_id}: local page of a hit evicted before adoption"
                    self.kv.pool.acquire(page)
                table.append(page)
        self.release_before(seq_id, first)

    def index(self, seq_id: int, column: int, block_hash: int, tokens: tuple) -> None:
        """A full, computed block: its local pages join the prefix cache (unlisted)."""
        cache = self.kv.pool.cache
        for group, table in enumerate(self.tables[seq_id]):
            page = table[column]
            if page != DROPPED and not cache.is_cached(page):
                cache.insert(page, local_hash(block_hash, group), tokens, listed=False)

    def release_before(self, seq_id: int, column: int) -> None:
        """Release the pages of columns before `column` (out of every later query's window)."""
        for table in self.tables[seq_id]:
            for index in range(min(column, len(table)) - 1, -1, -1):
                if table[index] == DROPPED:
                    break  # held columns are a suffix: the rest is released already
                self.kv.pool.release(table[index])
                table[index] = DROPPED

    def cut(self, seq_id: int, keep: int, num_tokens: int | None = None) -> None:
        """Forget columns from `keep` on, the last first (a pause, a free, a truncation); with
        `num_tokens`, also release what the query after that many tokens does not read."""
        for table in self.tables[seq_id]:
            for page in reversed(table[keep:]):
                if page != DROPPED:
                    self.kv.pool.release(page)
            del table[keep:]
        if num_tokens is not None:
            self.release_before(seq_id, self.first_needed(num_tokens))

    def forget(self, seq_id: int) -> None:
        self.cut(seq_id, 0)
        del self.tables[seq_id]

    def check_integrity(self, counted: list[int]) -> None:
        """Each local table as long as its global one, held pages a suffix within the window
        plus the columns not yet computed, cached pages under their derived hashes."""
        kv = self.kv
        assert self.tables.keys() == kv._tables.keys(), "local tables of unknown sequences"
        for seq_id, tables in self.tables.items():
            hashes = kv._hashes[seq_id]
            for group, table in enumerate(tables):
                assert len(table) == len(kv._tables[seq_id]), f"seq {seq_id}: local table {group} length"
                held = [page != DROPPED for page in table]
                assert held == sorted(held), f"seq {seq_id}: local group {group} holds a gap"
                for column, page in enumerate(table):
                    if page == DROPPED:
                        continue
                    counted[page] += 1
                    key = kv.pool.cache.key(page)
                    if key is not None:
                        assert column < len(hashes) and key[0] == local_hash(hashes[column], group), \
                            f"seq {seq_id}: local page {page} cached under another hash"
