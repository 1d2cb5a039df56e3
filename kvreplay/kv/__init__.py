"""The KV cache as a managed resource: block pool, prefix cache, manager, pressure policy.

    manager.KVManager       the only owner of block tables, ref counts, hashes and pins
      block_pool.BlockPool  ref counts and the two free lists (empty, cached in LRU order)
      prefix_cache          chained block hashes -> cached block, tokens re-checked on a hit
    policy                  watermarks and the pause-victim cost rule the scheduler applies
"""
from kvreplay.kv.manager import KVManager
from kvreplay.kv.policy import Watermarks

__all__ = ["KVManager", "Watermarks"]
