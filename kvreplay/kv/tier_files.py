"""The session tier's files: one file per block, keyed by its chained prefix-cache hash.

    <dir>/kvreplay-tier-<uid>/              0700, one per user
        <stamp digest>-<block hash>.kvt     0600; written to a .tmp name, then renamed

    | MAGIC (8) | header length (4, little endian) | header (JSON) | payload (raw K/V bytes) |

The header carries the version stamp (model identity, block size, dtype, layers, KV heads, head
dim), the block's hash and tokens, the payload's shape, length and blake2b checksum. A file with
another stamp belongs to another model or layout and is ignored (left in place); a file shorter
than its header says (torn: a crash mid-write can only leave a .tmp, but a disk can still lose a
tail) or whose payload fails its checksum is deleted and never loaded. These functions touch
files only, never the tier's index; the tier's background thread (a Worker) runs write_block,
read_block and remove.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

MAGIC = b"KVRTIER1"
SUFFIX = ".kvt"
_LENGTH = struct.Struct("<I")
_CHECKSUM_HEX = 32  # blake2b, 16 bytes


def stamp_digest(stamp: dict) -> str:
    """A short name for a version stamp (the prefix of its files' names)."""
    return hashlib.blake2b(json.dumps(stamp, sort_keys=True).encode(), digest_size=6).hexdigest()


def checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def file_name(digest: str, block_hash: int) -> str:
    return f"{digest}-{block_hash & (2**64 - 1):016x}{SUFFIX}"


def check_tier_dir(value) -> None:
    """kv_tier_dir's check at configuration time (the tier itself creates and probes it)."""
    if value is not None and os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(f"kv_tier_dir={value!r} is a file, not a directory: name a directory "
                         "(it is created if missing)")


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
    """Write one block file atomically (temporary name, fsync-free rename). Returns its size,
    which file_size(header, len(payload)) tells beforehand. A failed write leaves no file."""
    header = dict(header, payload_bytes=len(payload), checksum=checksum(payload))
    head = json.dumps(header).encode()
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(MAGIC + _LENGTH.pack(len(head)) + head)
            file.write(payload)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            remove(temporary)
        raise
    return len(MAGIC) + _LENGTH.size + len(head) + len(payload)


def file_size(header: dict, payload_bytes: int) -> int:
    """The size write_block(path, header, payload) will return for a payload of `payload_bytes`
    (the checksum is a fixed-length hex digest), known before the payload is hashed."""
    head = json.dumps(dict(header, payload_bytes=payload_bytes, checksum="0" * _CHECKSUM_HEX)).encode()
    return len(MAGIC) + _LENGTH.size + len(head) + payload_bytes


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
    if len(payload) != header["payload_bytes"] or checksum(payload) != header.get("checksum"):
        return None
    return payload


def read_block(path: Path, stamp: dict, block_hash: int, tokens: tuple[int, ...]) -> tuple[str, bytearray | None]:
    """Read and verify one block file; touches nothing but the file, so the tier's background
    thread may call it. ('ok', payload), ('other', None) when the file holds another block's
    tokens (a hash collision), ('torn', None) when it is not a whole file of this stamp and hash
    (unreadable, short, or unlinked meanwhile), ('checksum', None) when its payload is corrupted."""
    found = read_header(path)
    if found is None or found[0].get("stamp") != stamp or found[0].get("hash") != block_hash:
        return "torn", None
    header, offset = found
    if tuple(header.get("tokens", ())) != tuple(tokens):
        return "other", None
    payload = read_payload(path, header, offset)
    return ("checksum", None) if payload is None else ("ok", payload)


def scan(directory: Path, digest: str, stamp: dict, shape: tuple[int, ...]) -> tuple[list, int, int]:
    """This stamp's whole block files under `directory`, oldest first, as (hash, path, size);
    with how many files were ignored (another stamp's or shape's: left alone) and how many were
    torn (deleted; a temporary file whose writer no longer runs counts as torn)."""
    found, ignored, torn = [], 0, 0
    for path in directory.glob("*.tmp"):
        if not _writer_alive(path.name):  # a writer killed mid-write (kill -9) left it
            torn += 1
            remove(path)
    for path in directory.glob(f"*{SUFFIX}"):
        if not path.name.startswith(digest + "-"):
            ignored += 1
            continue
        header = read_header(path)
        if header is None:
            torn += 1
            remove(path)
        elif header[0].get("stamp") != stamp or tuple(header[0].get("shape", ())) != tuple(shape):
            ignored += 1
        else:
            info = path.stat()
            found.append((info.st_mtime, int(header[0]["hash"]), path, info.st_size))
    return [(block_hash, path, size) for _, block_hash, path, size in sorted(found)], ignored, torn


def _writer_alive(name: str) -> bool:
    """Whether the process that names itself in a temporary file's name still runs (write_block's
    `<file>.<pid>.tmp`, the probe's `.probe-<pid>.kvt.tmp`); names without a pid count as alive."""
    found = re.search(r"\.(\d+)\.tmp$", name) or re.search(r"^\.probe-(\d+)", name)
    if found is None:
        return True
    try:
        os.kill(int(found.group(1)), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def probe_read_seconds(directory: Path, payload: bytes | memoryview) -> float:
    """Seconds to read and verify a just-written file of `payload` (the disk tier's cost probe)."""
    path = directory / f".probe-{os.getpid()}{SUFFIX}.tmp"
    write_block(path, dict(stamp={}, hash=0, tokens=[], shape=[]), payload)
    started = time.perf_counter()
    header, offset = read_header(path)
    read_payload(path, header, offset)
    seconds = time.perf_counter() - started
    remove(path)
    return seconds


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class Worker:
    """The tier's one background thread for file jobs (writes, reads, unlinks), started on first
    use. A single worker runs jobs in submission order: a job sees every earlier job's files."""

    _live: weakref.WeakSet = weakref.WeakSet()  # workers with a thread (a new tier's scan waits)

    def __init__(self, directory: Path):
        self.directory = directory
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, job, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreplay-tier")
            Worker._live.add(self)
        return self._executor.submit(job, *args)

    def barrier(self) -> None:
        """Wait until every job submitted so far has finished."""
        executor = self._executor
        if executor is not None:
            try:
                executor.submit(int).result()
            except RuntimeError:  # shut down meanwhile: its jobs are finished
                pass

    def close(self) -> None:
        """Finish the jobs and stop the thread (a later submit starts another)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
            Worker._live.discard(self)

    @staticmethod
    def settle(directory: Path) -> None:
        """Wait for the jobs of every live worker on `directory` (so that a scan sees its files)."""
        for worker in list(Worker._live):
            if worker.directory == directory:
                worker.barrier()
