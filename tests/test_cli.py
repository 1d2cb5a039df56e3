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

    session = _run("chat", "--max-tokens", "8", input="Hello!\n/reset\nName a color.\n\n")
    assert session.returncode == 0, session.stderr
    assert session.stdout.count("assistant> ") == 2


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--max-tokens", "-3"], "max_tokens must be"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist"),
    (["generate", "hi", "--kv-cache-memory", "many"], "cannot parse size"),
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
