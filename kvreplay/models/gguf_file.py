"""Reading GGUF files with gguf-py: the header (metadata and tensor shapes) and tensor values.

gguf-py's reader parses every metadata array element by element: ~10 s for a 262,144-token
vocabulary (Gemma 3's). So a file's header is read once per process (kept, small, per file
identity: path, size, mtime), and the parsed reader is kept from that read until the file's
weights load (`open_for_load`), then let go: checking settings against a model's header before
loading it (engine/model_setup.py) costs no second parse.
"""
from __future__ import annotations

import functools
import os

import numpy as np

_kept_reader: dict[tuple, object] = {}  # at most one: file identity -> its parsed GGUFReader


def _file_key(path: str) -> tuple[str, int, int]:
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_size, stat.st_mtime_ns


def _open(path: str):
    from gguf import GGUFReader
    try:
        return GGUFReader(path)
    except Exception as exc:
        if "GGMLQuantizationType" in str(exc):  # a tensor type id gguf-py does not know
            raise ValueError(f"{path} stores a tensor in an unknown quant type ({exc}); kvreplay "
                             "loads the types gguf-py can dequantize") from exc
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_header(path: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(metadata, tensor shapes) of the GGUF file at `path`; don't change what it returns."""
    return _header(_file_key(path))


@functools.lru_cache(maxsize=8)
def _header(key: tuple[str, int, int]) -> tuple[dict, dict[str, tuple[int, ...]]]:
    reader = _open(key[0])
    _kept_reader.clear()
    _kept_reader[key] = reader
    return _metadata(reader), _tensor_shapes(reader)


def open_for_load(path: str):
    """The file's GGUFReader for reading its tensors: the one kept by the header read, handed
    over (and no longer kept), else a new one."""
    return _kept_reader.pop(_file_key(path), None) or _open(path)


def _tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, rows first (GGUF lists the fastest dimension first)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def _metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            continue  # large arrays; the tokenizer reads them itself
        try:
            meta[key] = field.contents()
        except Exception:  # unknown field layouts are not needed
            continue
    return meta


def dequantize(tensor, path: str) -> np.ndarray:
    """A GGUF tensor's values as float32 (gguf-py's dequantization: F32/F16/BF16, Q4_0..Q8_0 and
    the K-quants Q2_K..Q6_K among others)."""
    from gguf.quants import dequantize as gguf_dequantize
    try:
        array = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, a quant "
                         f"type gguf-py cannot dequantize ({exc})") from exc
    return array.astype(np.float32, copy=False)
