"""kvreplay: an LLM inference engine whose KV cache is a tiered, recomputable resource."""
from kvreplay.api import LLM
from kvreplay.config import EngineConfig
from kvreplay.outputs import CompletionOutput, RequestOutput
from kvreplay.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
