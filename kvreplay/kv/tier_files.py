"""The session tier's files: one file per block, keyed by its chained prefix-cache hash.

    <dir>/kvreplay-tier-<uid>/              0700, one per user
        <stamp digest>-<block hash>.kvt     0600; written to a .tmp name, then renamed

    | MAGIC (8) | header length (4, little endian) | header (JSON) | payload (raw K/V bytes) |

The header carries the version stamp (model identity, block size, dtype, layers, KV heads, head
dim), the block's hash and tokens, the payload's shape, length and blake2b checksum. A file with
another stamp belongs to another model or layout and is ignored (left in place); a file shorter
than its header says (torn: a crash mid-write can only leave a .tmp, but a disk can still lose a
tail) or whose payload fails its checksum is deleted and never loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

MAGIC = b"KVRTIER1"
SUFFIX = ".kvt"
_LENGTH = struct.Struct("<I")


def stamp_digest(stamp: dict) -> str:
    """A short name for a version stamp (the prefix of its files' names)."""
    return hashlib.blake2b(json.dumps(stamp, sort_keys=True).encode(), digest_size=6).hexdigest()


def checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def file_name(digest: str, block_hash: int) -> str:
    return f"{digest}-{block_hash & (2**64 - 1):016x}{SUFFIX}"


def prepare_dir(directory: str | os.PathLike) -> Path:
    """The per-user directory under `directory` (created 0700), checked writable. A ValueError
    names the remedy when `directory` is a file or cannot be written."""
    base = Path(directory).expanduser()
    if base.exists() and not base.is_dir():
        raise ValueError(f"kv_tier_dir={str(directory)!r} is a file, not a directory: name a "
                         "directory (it is created if missing)")
    path = base / f"kvreplay-tier-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"kv_tier_dir={str(directory)!r} cannot be written ({error.strerror}): "
                         "name a writable directory, or leave kv_tier_dir unset for no disk tier") from None
    return path


def write_block(path: Path, header: dict, payload: bytes | memoryview) -> int:
    """Write one block file atomically (temporary name, fsync-free rename). Returns its size."""
    header = dict(header, payload_bytes=len(payload), checksum=checksum(payload))
    head = json.dumps(header).encode()
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(MAGIC + _LENGTH.pack(len(head)) + head)
        file.write(payload)
    os.replace(temporary, path)
    return len(MAGIC) + _LENGTH.size + len(head) + len(payload)


def read_header(path: Path) -> tuple[dict, int] | None:
    """(header, payload offset), or None when the file is not a whole tier file (bad magic,
    unreadable header, or shorter than its payload length: torn)."""
    try:
        with open(path, "rb") as file:
            start = file.read(len(MAGIC) + _LENGTH.size)
            if len(start) < len(MAGIC) + _LENGTH.size or start[:len(MAGIC)] != MAGIC:
                return None
            (length,) = _LENGTH.unpack(start[len(MAGIC):])
            header = json.loads(file.read(length))
        offset = len(MAGIC) + _LENGTH.size + length
        if os.path.getsize(path) != offset + int(header["payload_bytes"]):
            return None
        return header, offset
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_payload(path: Path, header: dict, offset: int) -> bytearray | None:
    """The payload, or None when it is short or fails its checksum (corrupted)."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            payload = bytearray(file.read())
    except OSError:
        return None
    if len(payload) != header["payload_bytes"] or checksum(payload) != header["checksum"]:
        return None
    return payload


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
