"""Kept for imports: the KV manager lives in `kvreplay.kv`."""
from kvreplay.kv.manager import KVManager

__all__ = ["KVManager"]
