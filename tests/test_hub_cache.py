"""Models by Hugging Face id, found in a local Hugging Face cache laid out as huggingface_hub
writes it (models--Org--Name/{refs,snapshots,blobs}), built here in tmp_path from the files the
default model loads from. No network: an id not in the cache is a clear error naming the folder."""
from __future__ import annotations

import os

import pytest

from kvreplay.models.hub_cache import find_cached_model, hub_cache_dir, is_repo_id
from kvreplay.models.loader import DEFAULT_MODEL_FILE, read_model_config, resolve_model_path
from kvreplay.server.config import model_name_for

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def fake_hub_cache(root, model_path: str, revision: str = "0123abcd", files=None) -> str:
    """A hub cache under `root` holding REPO_ID at `revision` (refs/main names it), its snapshot
    linking to blobs as huggingface_hub does; the GGUF blob links to the real model file.
    Returns the snapshot folder."""
    repo = root / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for name, target in (files or {DEFAULT_MODEL_FILE: model_path}).items():
        blob = repo / "blobs" / f"blob-{revision}-{name}"
        if target is None:
            blob.write_text("{}")
        else:
            blob.symlink_to(target)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return str(snapshot)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_an_id_finds_the_gguf_of_the_snapshot_main_names(hub, model_path):
    older = fake_hub_cache(hub, model_path, revision="older")
    main = fake_hub_cache(hub, model_path, revision="newer")
    repo = hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (repo / "refs" / "main").write_text("older\n")
    os.utime(main, (2e9, 2e9))  # the newer snapshot is written last, but main names the older
    assert resolve_model_path(REPO_ID) == os.path.join(older, DEFAULT_MODEL_FILE)
    (repo / "refs" / "main").unlink()  # without refs/main: the most recent snapshot
    assert find_cached_model(REPO_ID) == os.path.join(main, DEFAULT_MODEL_FILE)
    assert read_model_config(REPO_ID).num_layers == 30  # the GGUF's header, read through the link


def test_a_safetensors_snapshot_is_a_model_directory(hub, model_path):
    snapshot = fake_hub_cache(hub, model_path, files={"config.json": None,
                                                      "model.safetensors": None})
    assert resolve_model_path(REPO_ID) == snapshot


@pytest.mark.parametrize("files, words", [
    ({"a.gguf": None, "b.gguf": None}, ["2 GGUF files", "a.gguf, b.gguf", "pass the path"]),
    ({"README.md": None}, ["neither config.json", "huggingface-cli download"]),
])
def test_a_snapshot_without_one_model_is_a_clear_error(hub, model_path, files, words):
    fake_hub_cache(hub, model_path, files=files)
    with pytest.raises(ValueError) as error:
        resolve_model_path(REPO_ID)
    assert all(word in str(error.value) for word in words), error.value


def test_an_id_not_in_the_cache_names_the_folder_searched(hub):
    with pytest.raises(ValueError) as error:
        resolve_model_path("Org/Missing-1B")
    message = str(error.value)
    assert str(hub / "models--Org--Missing-1B" / "snapshots") in message
    assert "huggingface-cli download Org/Missing-1B" in message
    with pytest.raises(ValueError, match="does not exist"):  # a path, not an id
        resolve_model_path("./no/such/model.gguf")


def test_the_cache_folder_follows_huggingface_hub(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == str(tmp_path / "hub")


def test_ids_and_paths_are_told_apart():
    assert is_repo_id(REPO_ID) and is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    for name in ("model.gguf", "/abs/model", "./a/b", "a/b/c", "../x", "Org/..", "Org/", "/Org/Name"):
        assert not is_repo_id(name), name
    assert model_name_for(REPO_ID) == REPO_ID  # served under its id, as vLLM does
    assert model_name_for("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
