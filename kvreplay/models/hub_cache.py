"""Models named by Hugging Face id (`HuggingFaceTB/SmolLM2-135M-Instruct`), found in the local
Hugging Face cache. Nothing is downloaded: an id that is not cached is a ValueError naming the
folder searched, so a server never reaches for the network at startup.

The cache is laid out as huggingface_hub writes it:

    $HF_HUB_CACHE (else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub)
      models--Org--Name/
        refs/main                  the revision `main` points to
        snapshots/<revision>/      the repository's files (links into blobs/)
        blobs/<hash>
"""
from __future__ import annotations

import os
import re

# Org/Name as the Hub spells repository ids: letters, digits, '-', '_', '.'
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_cache_dir() -> str:
    """The Hugging Face hub cache folder, resolved the way huggingface_hub resolves it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "huggingface", "hub")


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hub id (Org/Name) rather than a path: one slash, no '..'."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def find_cached_model(repo_id: str) -> str:
    """The local path to load for `repo_id`: its snapshot folder (config.json + *.safetensors),
    or the snapshot's one .gguf file for a GGUF-only repository. The snapshot is the one
    refs/main names, else the most recently written. A ValueError says what is missing."""
    cache = hub_cache_dir()
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo_dir, "snapshots")
    remedy = (f"download it once (e.g. `huggingface-cli download {repo_id}`; the cache is "
              f"$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub) or pass a local path")
    names = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    if not names:
        raise ValueError(f"model {repo_id!r} is not a local path and is not in the Hugging Face "
                         f"cache (searched {snapshots}): {remedy}")
    snapshot = _main_snapshot(repo_dir, names) or max(
        (os.path.join(snapshots, name) for name in names), key=os.path.getmtime)
    files = os.listdir(snapshot)
    ggufs = sorted(name for name in files if name.endswith(".gguf"))
    if any(name.endswith(".safetensors") for name in files) or (not ggufs and "config.json" in files):
        return snapshot
    if len(ggufs) == 1:
        return os.path.join(snapshot, ggufs[0])
    if ggufs:
        raise ValueError(f"{snapshot} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}): pass "
                         f"the path of the one to load")
    raise ValueError(f"the cached snapshot {snapshot} of {repo_id!r} has neither config.json with "
                     f"*.safetensors nor a .gguf file: {remedy}")


def _main_snapshot(repo_dir: str, names: list[str]) -> str | None:
    """The snapshot refs/main points to, if that file exists and names one that is present."""
    try:
        with open(os.path.join(repo_dir, "refs", "main")) as handle:
            revision = handle.read().strip()
    except OSError:
        return None
    return os.path.join(repo_dir, "snapshots", revision) if revision in names else None
