"""Server settings (the engine has its own EngineConfig). Each field is declared with its help,
default and check (kvreplay.validate.knob); `kvreplay serve`'s server flags are generated from
them (kvreplay.commands.flags)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from kvreplay.models.hub_cache import is_repo_id
from kvreplay.validate import boolean, check_choice, check_knobs, ints, knob, knob_docs, numbers

DEFAULT_MODEL_NAME = "kvreplay-default"
API_KEY_ENV = "KVREPLAY_API_KEY"
# max_prompt_bytes' default per token of the model's context: text averages 3-5 bytes a token,
# so a prompt over this many bytes cannot fit the context, and is refused before tokenizing
PROMPT_BYTES_PER_TOKEN = 16
ROUTINGS = ("prefix", "round-robin")


def _non_empty_name(name, value, owner):
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value


def _real_key(name, value, owner):
    if value is not None and not value.strip():
        raise ValueError(f"{name} is empty: give a real key or leave it unset")
    return value


@knob_docs
@dataclass
class ServerConfig:
    """Knobs of the HTTP server; each field's help below is also its `kvreplay serve` flag's."""
    host: str = knob("127.0.0.1", "address to bind; loopback unless told otherwise")
    port: int = knob(8000, "TCP port (0: any free one)", check=ints(0, 65535))
    served_model_name: str = knob(
        DEFAULT_MODEL_NAME, "the model id clients name in requests and see in /v1/models",
        cli_default=None,
        default_help=f"{DEFAULT_MODEL_NAME}, or --model: a Hugging Face id as given, a path's stem",
        check=_non_empty_name)
    api_key: str | None = knob(
        None, "when set, every route but /health, /version and the docs needs 'Authorization: "
              "Bearer KEY' (the scheme in any case; a request with several Authorization headers "
              "gets 400)",
        default_help=f"${API_KEY_ENV} for the flag, else no key", check=_real_key)
    max_queued_seqs: int = knob(
        256, "sequences (prompts x n) admitted and unfinished at most; beyond it requests get "
             "429 (with Retry-After) at once", check=ints(1))
    max_seqs_per_request: int = knob(
        64, "sequences (prompts x n) one request may ask for, so that one request cannot fill "
            "the queue; beyond it (or beyond --max-queued-seqs) a request gets 400", check=ints(1))
    max_request_bytes: int = knob(
        1 << 20, "largest request body accepted (413 beyond it)", check=ints(1))
    max_prompt_bytes: int | None = knob(
        None, "largest prompt, in UTF-8 bytes (a chat: its messages), that is tokenized; a larger "
              "one gets 400 at once", type=int,
        default_help=f"{PROMPT_BYTES_PER_TOKEN} bytes per token of the model's context",
        check=ints(1, optional=True))
    tokenize_nice: int = knob(
        10, "added to the OS niceness of the thread that tokenizes prompts (Linux), so that "
            "tokenizing a long prompt slows the running streams less (it waits for them "
            "instead); 0 leaves it at the server's", check=ints(0, 19))
    shutdown_timeout_s: float = knob(
        10.0, "seconds in-flight requests may run after SIGTERM (the port stays open meanwhile: "
              "/health and new requests get 503) before they are cut, ending with finish_reason "
              "'length' and stop_reason 'shutdown'",
        flag="--shutdown-timeout", check=numbers(0))
    debug_endpoints: bool = knob(
        False, "serve GET /debug/kv (KV pool state and an integrity check)", check=boolean)
    docs: bool = knob(
        True, "serve the OpenAPI docs: Swagger UI at /docs and the schema at /openapi.json, "
              "without the API key (a browser sends none; they describe the routes and run "
              "nothing)", flag="--no-docs", check=boolean)
    console: bool = knob(
        True, "serve the web console at /console (and / redirecting to it): a chat playground "
              "and a live map of the KV cache drawn from GET /v1/kv/state; the page loads "
              "without the API key and asks for it", flag="--no-console", check=boolean)
    metrics_public: bool = knob(
        False, "serve GET /metrics without the API key (for Prometheus scrapers); every other "
               "route but /health still needs it", check=boolean)

    replicas: int = knob(
        0, "engine replicas behind the app on Ray Serve (docs/multi-node.md), each request "
           "routed to the replica that holds its prefix, else the least loaded; 0: one engine in "
           "this process, no Ray (needs the serve extra)", check=ints(0))
    ray_address: str | None = knob(
        None, "with --replicas: the Ray cluster to join (e.g. ray://head:10001 or auto)",
        type=str, default_help="a local cluster started for this server")
    replica_threads: int = knob(
        1, "with --replicas: CPU threads (and Ray CPUs) per replica", check=ints(1))
    replica_routing: str = knob(
        "prefix", "with --replicas: prefix (affinity by the prompt's first blocks, falling back "
                  "to the least loaded by queue depth and KV usage) or round-robin",
        choices=ROUTINGS, check=lambda name, value, owner: check_choice(name, value, ROUTINGS))

    def __post_init__(self):
        check_knobs(self)
        if self.ray_address is not None and not self.replicas:
            raise ValueError("--ray-address needs --replicas N: the replicas run on that cluster")

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def model_name_for(model: str | None) -> str:
    """The default served name: a Hugging Face id as given (Org/Name, found in the local cache),
    else the file or folder stem of `--model`, else kvreplay-default."""
    if not model:
        return DEFAULT_MODEL_NAME
    if is_repo_id(model) and not os.path.exists(os.path.expanduser(model)):
        return model
    return Path(model.rstrip("/")).stem
