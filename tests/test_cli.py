"""The command line as a user types it: help texts, a real generation, clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(*args: str, input: str | None = None, timeout: int = 180,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvreplay", *args], capture_output=True, text=True,
                          input=input, timeout=timeout, env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["serve"], ["plan"], ["bench"]])
def test_every_command_has_help(command):
    result = _run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: kvreplay" in result.stdout


def test_generate_json_and_chat_session(llm32):
    result = _run("generate", "--chat", "What is the capital of France?", "--max-tokens", "12",
                  "--dtype", "float32", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    from kvreplay import SamplingParams
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm32.chat(conversation, SamplingParams(max_tokens=12, temperature=0))
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text
    assert record["kv"]["prompt_tokens"] == len(llm32.chat_prompt_ids(conversation))

    # the startup summary (issue 39, item 7), and a progress bar for a batch or --json
    for words in ("loading ", "ready in", "KV cache:", "blocks x 16 tokens", "bytes per token",
                  "max concurrency at 8,192 tokens per request", "policy full: watermarks",
                  "threads; compiled CPU kernels", "generating"):
        assert words in result.stderr, (words, result.stderr[-3000:])

    session = _run("chat", "--max-tokens", "8", input="Hello!\n/reset\nName a color.\n\n")
    assert session.returncode == 0, session.stderr
    assert session.stdout.count("assistant> ") == 2
    assert "(history cleared)" in session.stdout  # /reset confirms
    assert session.stdout.count("[cut at --max-tokens 8]") >= 1, session.stdout


def test_chat_streams_each_reply_as_it_is_made(llm32, monkeypatch):
    """`kvreplay chat` writes a reply piece by piece as the engine makes it (the same text as
    LLM.chat), then marks a reply cut by --max-tokens."""
    from kvreplay import SamplingParams
    from kvreplay.cli import build_parser
    from kvreplay.commands import generate

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    lines = iter(["Tell me about the sea.", ""])
    out = Recorder()
    monkeypatch.setattr(generate, "_make_llm", lambda args: llm32)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    monkeypatch.setattr("sys.stdout", out)
    args = build_parser().parse_args(["chat", "--max-tokens", "24"])
    assert args.func(args) == 0
    start = out.writes.index("assistant> ") + 1
    end = next(i for i, text in enumerate(out.writes) if "[cut at --max-tokens 24]" in text)
    pieces = out.writes[start:end]
    expected = llm32.chat([{"role": "user", "content": "Tell me about the sea."}],
                          SamplingParams(max_tokens=24, temperature=0))
    assert expected.finish_reason == "length"
    assert "".join(pieces) == expected.text and len(pieces) >= 10, pieces


def test_streamed_text_holds_back_what_a_stop_string_may_cut():
    from kvreplay.commands.generate import _TextPrinter

    class Out(list):
        write, flush = list.append, lambda self: None
    out = Out()
    printer = _TextPrinter(["\n\nUser"], out)
    printer.show("Hello")
    printer.show("Hello\n\nUs")       # may be the start of the stop string: held back
    printer.show("Hello\ufffd")       # a character still being decoded: held back
    printer.show("Hello", final=True)  # the engine cut the text before the stop string
    assert out == ["Hello"]
    printer.show("Hello world", final=True)
    assert out == ["Hello", " world"]


def test_generate_by_hugging_face_id_streams_and_logs_each_step(tmp_path, llm32):
    """--model Org/Name loads the snapshot from the local Hugging Face cache ($HF_HUB_CACHE, no
    network); one prompt's text streams to stdout; -v logs a line per engine step."""
    from kvreplay import SamplingParams
    from test_hub_cache import REPO_ID, fake_hub_cache
    from kvreplay.models.loader import default_model_path
    snapshot = fake_hub_cache(tmp_path, default_model_path())
    result = _run("-v", "generate", "The capital of France is", "--model", REPO_ID,
                  "--max-tokens", "6", "--dtype", "float32", env={"HF_HUB_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    expected = llm32.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0))
    assert result.stdout == expected.text + "\n"
    assert f"loading {snapshot}/SmolLM2-135M-Instruct.Q4_1.gguf" in result.stderr
    assert "[cut at --max-tokens 6]" in result.stderr
    steps = [line for line in result.stderr.splitlines() if "kvreplay.steps: step " in line]
    assert len(steps) == 6, result.stderr[-3000:]
    assert f"0 decode + 1 prefill ({len(expected.prompt_token_ids)} tokens)" in steps[0], steps[0]
    assert "1 decode + 0 prefill (0 tokens), 1 sampled" in steps[1] and "KV 1/" in steps[1], steps[1]


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--max-tokens", "-3"], "max_tokens must be"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist"),
    (["generate", "hi", "--model", "NoSuchOrg/no-such-model"], "is not in the Hugging Face cache (searched "),
    (["generate", "hi", "--kv-cache-memory", "many"], "cannot parse size"),
    (["generate", "hi", "--model", "gemma3-270m", "--policy", "window", "--no-hybrid-kv"], "needs hybrid_kv=True"),
    (["serve", "--ray-address", "auto"], "--ray-address needs --replicas N"),
    (["serve", "--replicas", "-1"], "replicas must be an integer >= 0"),
    (["serve", "--kv-events", "localhost:5557"], "kv_events must be a ZMQ endpoint like tcp://*:5557"),
])
def test_bad_input_is_one_clear_line(args, message):
    result = _run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name, value", [("KVREPLAY_HUGE_PAGES", "yes"), ("KVREPLAY_AMX_PANELS", "off"),
                                         ("KVREPLAY_CPU_KERNELS", "maybe"), ("KVREPLAY_INT_PRODUCTS", "4")])
def test_a_mistyped_environment_switch_is_one_clear_line(name, value):
    """A switch the engine reads from the environment, set to a value it does not know: exit 2
    with a line naming the variable (the kernels' own switches were taken as on whatever they held)."""
    result = _run("generate", "hi", "--max-tokens", "2", env={name: value})
    assert result.returncode == 2, result.stderr[-2000:]
    assert name in result.stderr and repr(value) in result.stderr
    assert "Traceback" not in result.stderr


def test_every_byte_size_flag_takes_a_size_with_a_unit():
    """A knob whose help offers 'a size like 2GiB' must take one on the command line (the flag's
    type once came from an integer default and refused '16MiB')."""
    from kvreplay.cli import build_parser
    from kvreplay.commands.flags import engine_config_from_args
    sizes = {"--kv-cache-memory": "48MiB", "--kv-tier-memory": "16MiB", "--kv-tier-disk": "1GiB"}
    args = build_parser().parse_args(["serve", *(x for pair in sizes.items() for x in pair)])
    config = engine_config_from_args(args)
    assert (config.kv_cache_bytes, config.kv_tier_memory_bytes, config.kv_tier_disk_bytes) == (
        48 << 20, 16 << 20, 1 << 30)
