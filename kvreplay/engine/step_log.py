"""One debug line per engine step (`kvreplay -v`): what the step computed (decode rows, prefill
sequences and their tokens), what waits, KV usage and the step's time. The line is read off the
sequences and counters around `LLMEngine.step()`, so the step itself carries no logging, and
nothing is counted unless debug logging is on."""
from __future__ import annotations

import logging
import time

from kvreplay.outputs import RequestOutput

logger = logging.getLogger("kvreplay.steps")


def step(engine) -> list[RequestOutput]:
    """`engine.step()`, logged at debug level on the `kvreplay.steps` logger."""
    if not logger.isEnabledFor(logging.DEBUG):
        return engine.step()
    scheduler, counters = engine.scheduler, engine.counters
    before = [(seq, seq.num_computed_tokens, seq.num_uncomputed_tokens)
              for seq in [*scheduler.running, *scheduler.waiting]]
    pauses, sampled, fires = counters.pauses, counters.generation_tokens, counters.need_fires
    started = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - started
    decodes = prefills = prefill_tokens = 0
    for seq, computed, uncomputed in before:
        grown = seq.num_computed_tokens - computed
        if computed >= seq.num_prompt_tokens and uncomputed == 1 and grown == 1:
            decodes += 1  # its last sampled token went through the model
        elif grown > 0:  # a prompt's chunk, or a paused sequence's recompute
            prefills += 1
            prefill_tokens += grown
    kv = engine.kv
    line = (f"step {counters.steps}: {decodes} decode + {prefills} prefill ({prefill_tokens} tokens), "
            f"{counters.generation_tokens - sampled} sampled; running {engine.num_running}, waiting "
            f"{engine.num_waiting}; KV {kv.num_used_blocks}/{kv.num_blocks} blocks "
            f"({kv.num_used_blocks / kv.num_blocks:.1%}); {seconds * 1e3:.1f} ms")
    if counters.pauses > pauses:
        line += f"; paused {counters.pauses - pauses}"
    if counters.need_fires > fires:
        line += f"; replay needed by {counters.need_fires - fires}"
    logger.debug(line)
    return outputs
