"""The replay knobs chosen per model (kvreplay/engine/calibration.py): the calibration pass on the
real model, its cache, and how "auto" resolves per policy."""
from __future__ import annotations

import json

import pytest
import torch

from kvreplay.config import EngineConfig
from kvreplay.engine import calibration
from kvreplay.engine.calibration import (THRESHOLD_FALLBACK, Calibration, calibrated_defaults, choose_threshold,
                                         format_layers, replay_knobs)

# A 6-layer profile (weakest planted fact, loudest plain text per layer): layer 4 carries the fact
# (0.9 against plain text's 0.1), layer 1 reads plain text loudly (0.2), layer 2 cannot tell
# them apart (0.2 against 0.2).
PLANTED = (0.05, 0.5, 0.2, 0.05, 0.9, 0.6)
ORDINARY = (0.05, 0.2, 0.2, 0.05, 0.1, 0.1)


def test_format_layers():
    assert format_layers((20, 21, 22, 23)) == "20-23"
    assert format_layers([23, 3, 7, 8]) == "3,7-8,23"
    assert format_layers([5]) == "5"


def test_threshold_is_the_geometric_mean_of_weakest_fact_and_loudest_plain_text_over_the_layers_read():
    assert choose_threshold(PLANTED, ORDINARY, [4]) == 0.3           # sqrt(0.9 x 0.1)
    assert choose_threshold(PLANTED, ORDINARY, [4, 5]) == 0.3        # the largest of each side
    assert choose_threshold(PLANTED, ORDINARY, range(6)) == 0.42     # sqrt(0.9 x 0.2): layer 1's plain text
    assert choose_threshold(PLANTED, ORDINARY, [2]) == THRESHOLD_FALLBACK  # 0.2 vs 0.2: no threshold
    assert choose_threshold((0.8,), (0.0,), [0]) == 0.03             # never 0 (always replay)
    with pytest.raises(ValueError, match="not all in a profile of 6 layers"):
        choose_threshold(PLANTED, ORDINARY, [4, 6])


def test_calibration_threshold_follows_the_layers_read():
    found = Calibration((4,), 32, "calibrated", planted_low=PLANTED, ordinary_high=ORDINARY, replay_threshold=0.3)
    assert found.threshold_for([4]) == 0.3 and found.threshold_for(range(6)) == 0.42
    assert "replay_threshold=0.3 (calibrated)" in found.describe()
    fallback = Calibration((0, 1), 32, "every layer: fewer than 8 layers")
    assert fallback.threshold_for([0, 1]) == THRESHOLD_FALLBACK


def test_config_accepts_auto_all_and_lists():
    config = EngineConfig()
    assert config.need_layers == "auto" and config.heavy_tokens == "auto"
    assert config.replay_threshold == "auto" and EngineConfig(replay_threshold=0.5).replay_threshold == 0.5
    for bad in ("often", 1.5, -0.1, True):
        with pytest.raises(ValueError, match="replay_threshold"):
            EngineConfig(replay_threshold=bad)
    assert EngineConfig(need_layers="all").need_layer_set is None
    assert EngineConfig(need_layers="20-23").need_layer_set == frozenset({20, 21, 22, 23})
    assert EngineConfig(need_layers="none").need_layer_set == frozenset()
    with pytest.raises(ValueError, match="auto, all, none"):
        EngineConfig(need_layers="deep")
    with pytest.raises(ValueError, match="heavy_tokens"):
        EngineConfig(heavy_tokens="many")
    with pytest.raises(ValueError, match="heavy_tokens"):
        EngineConfig(heavy_tokens=-16)


def test_cli_flags_take_auto_or_numbers():
    import argparse
    from kvreplay.commands.flags import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).heavy_tokens == "auto"
    assert engine_config_from_args(parser.parse_args([])).replay_threshold == "auto"
    config = engine_config_from_args(parser.parse_args(["--heavy-tokens", "48", "--need-layers", "all",
                                                        "--replay-threshold", "0.5"]))
    assert config.heavy_tokens == 48 and config.need_layer_set is None and config.replay_threshold == 0.5
    assert engine_config_from_args(parser.parse_args(["--need-layers", "none"])).need_layer_set == frozenset()


def test_index_share_is_the_key_index_against_the_kv_a_dropped_block_frees():
    from types import SimpleNamespace
    smol = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, sliding_window=None, local_layers=())
    assert calibration.index_share(smol, {18, 20, 21, 23}, 16) == pytest.approx(0.025)  # 4 x 0.625%
    assert calibration.index_share(smol, None, 16, dtype_bytes=4) == pytest.approx(30 * 0.003125)
    gemma = SimpleNamespace(num_layers=18, num_kv_heads=1, head_dim=256, sliding_window=512,
                            local_layers=tuple(i for i in range(18) if i % 6 != 5))
    assert calibration.index_share(gemma, {17}, 16) == pytest.approx(0.0625)  # of 3 global layers' K/V
    assert calibration.index_share(gemma, None, 16) == pytest.approx(3 * 0.0625)


def test_calibration_on_the_real_model_finds_retrieval_layers(llm32):
    """Two planted facts are enough to see where SmolLM2-135M's retrieval heads are (layers 14-24
    in the full pass; the first 7 and last 5 layers never carry the fact)."""
    engine = llm32.engine
    result = calibration.calibrate(engine.model, engine.tokenizer, 16, cases=2)
    assert len(result.need_layers) == 4 and all(14 <= layer <= 24 for layer in result.need_layers)
    chosen = list(result.need_layers)
    assert min(result.planted[i] - result.ordinary[i] for i in chosen) > 0.3
    assert result.heavy_tokens == 32  # the needle's block ranks first: the budget's floor
    plain, fact = max(result.ordinary_high[i] for i in chosen), max(result.planted_low[i] for i in chosen)
    assert plain < result.replay_threshold < fact


def test_cache_is_keyed_and_read_back(tmp_path, monkeypatch, llm32):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_pass(model, tokenizer, block_size, kernel=None):
        calls.append(block_size)
        return Calibration((3, 9), 48, "calibrated", (0.0,) * 30, (0.0,) * 30, (0.0,) * 30, (0.0,) * 30, 0.4)

    monkeypatch.setattr(calibration, "calibrate", fake_pass)
    engine = llm32.engine
    first = calibrated_defaults(engine.model, engine.tokenizer, engine.model_source, 16)
    again = calibrated_defaults(engine.model, engine.tokenizer, engine.model_source, 16)
    assert calls == [16] and first.source == "calibrated" and again.source.startswith("cached in")
    assert (again.need_layers, again.heavy_tokens, again.replay_threshold) == ((3, 9), 48, 0.4)
    calibrated_defaults(engine.model, engine.tokenizer, engine.model_source, 32)  # another key
    assert calls == [16, 32]
    files = sorted((tmp_path / "kvreplay" / "calibration").iterdir())
    assert len(files) == 2 and all("float32" in f.name for f in files)
    files[0].write_text("{not json")  # a damaged cache file is recomputed, not trusted
    calibrated_defaults(engine.model, engine.tokenizer, engine.model_source, 16)
    assert len(calls) == 3 and json.loads(files[0].read_text())["need_layers"] == [3, 9]
    saved = json.loads(files[0].read_text())
    del saved["replay_threshold"]  # a file from before the threshold was calibrated: recomputed
    files[0].write_text(json.dumps(saved))
    calibrated_defaults(engine.model, engine.tokenizer, engine.model_source, 16)
    assert len(calls) == 4


def test_small_or_fileless_models_read_every_layer(llm32, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = llm32.engine
    fileless = calibrated_defaults(engine.model, engine.tokenizer, str(tmp_path / "missing"), 16)
    assert fileless.need_layers == tuple(range(30)) and fileless.heavy_tokens == 32
    assert fileless.replay_threshold == THRESHOLD_FALLBACK

    class Shallow:
        config = type("C", (), {"num_layers": 2})()
    shallow = calibrated_defaults(Shallow(), engine.tokenizer, engine.model_source, 16)
    assert shallow.need_layers == (0, 1) and not (tmp_path / "kvreplay").exists()


def test_auto_resolves_per_policy(llm32, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    planted, ordinary = [0.0] * 30, [0.05] * 30
    planted[20], planted[21], ordinary[5] = 0.8, 0.45, 0.2
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: Calibration(
        (20, 21), 64, "calibrated", planted_low=tuple(planted), ordinary_high=tuple(ordinary), replay_threshold=0.2))
    engine = llm32.engine
    args = (engine.model, engine.tokenizer, engine.model_source)
    assert replay_knobs(EngineConfig(), *args) == (None, 0, THRESHOLD_FALLBACK, None)  # full: no pass
    layers, heavy, threshold, found = replay_knobs(EngineConfig(policy="replay"), *args)
    assert layers == frozenset({20, 21}) and heavy == 64 and threshold == 0.2 and found is not None
    # an explicit value wins; an auto threshold follows the layers configured (5 and 20: 0.8, 0.2)
    _, _, threshold, _ = replay_knobs(EngineConfig(policy="replay", replay_threshold=0.9), *args)
    assert threshold == 0.9
    _, _, threshold, _ = replay_knobs(EngineConfig(policy="replay", need_layers="5,20"), *args)
    assert threshold == 0.4
    assert replay_knobs(EngineConfig(policy="replay", need_layers="all", heavy_tokens=0, replay_threshold=0.65),
                        *args) == (None, 0, 0.65, None)
    layers, heavy, _, _ = replay_knobs(EngineConfig(policy="sparse"), *args)
    assert heavy == 0
    # under a ratio, auto reads no layer once the index would take more than an eighth of the
    # budget (layers 20-21 of 30 in fp32: 0.625% of a dropped block); a named list is kept
    assert replay_knobs(EngineConfig(policy="replay", resident_ratio=0.1), *args)[0] == frozenset({20, 21})
    layers, _, threshold, _ = replay_knobs(EngineConfig(policy="replay", resident_ratio=0.02), *args)
    assert layers == frozenset() and threshold == THRESHOLD_FALLBACK
    named = EngineConfig(policy="replay", resident_ratio=0.02, need_layers="20-21")
    assert replay_knobs(named, *args)[0] == frozenset({20, 21})


def test_the_engine_uses_the_calibrated_knobs(tmp_path, monkeypatch):
    from kvreplay import LLM
    from kvreplay.engine import summary
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "calibrate",
                        lambda *a, **k: Calibration((20, 23), 48, "calibrated", planted_low=(0.5,) * 30,
                                                    ordinary_high=(0.1,) * 30, replay_threshold=0.22))
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", policy="replay")
    engine = llm.engine
    assert engine.runner.need_layers == frozenset({20, 23})
    assert engine.scheduler.reclaim.heavy_blocks == 3
    assert engine.scheduler.replay.threshold == 0.22
    assert "replay_threshold 0.22, need_layers 20,23" in "\n".join(summary.describe(engine))
    assert engine.kv.key_index.layers == [20, 23]  # the key index keeps only the layers read


def test_plan_says_what_auto_resolves_to(tmp_path, monkeypatch, capsys, model_path):
    from kvreplay.cli import main
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["plan", "--context", "1024"]) == 0
    assert "not calibrated yet" in capsys.readouterr().out
    path = calibration.cache_path(calibration.model_digest(model_path), torch.bfloat16, 16)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"need_layers": [20, 21], "heavy_tokens": 48, "planted": [0.0], "ordinary": [0.0],
                                "planted_low": [0.0], "ordinary_high": [0.0], "replay_threshold": 0.37}))
    assert main(["plan", "--context", "1024"]) == 0
    assert "need_layers=20-21, heavy_tokens=48, replay_threshold=0.37 (cached in" in capsys.readouterr().out
    assert main(["plan", "--context", "1024", "--resident-ratio", "0.1"]) == 0
    assert "need_layers none" not in capsys.readouterr().out  # 2 layers: 1.25% of a block fits 0.1
    assert main(["plan", "--context", "1024", "--resident-ratio", "0.02"]) == 0
    assert "at resident_ratio 0.02, need_layers none: the key index of need_layers 20-21 (1.25% of each" \
        in capsys.readouterr().out
