"""Structured output: a request's `response_format` as a grammar (llguidance), one matcher per
sequence, and the step's token masks (docs/architecture.md, "Structured output").

llguidance was chosen over xgrammar and outlines-core (docs/benchmarks.md, "Structured output"):
no dependencies of its own, a JSON schema compiles in ~1 ms with no per-grammar precomputation
over the vocabulary, and a mask takes ~40 us a row (1.3 ms for 32 rows, on one thread).

Life of the state: the engine compiles a matcher per sequence when the request is added (a bad
schema is a ValueError, the server's 400), `mask` bans every token the grammar does not allow in
the rows of constrained sequences, `accept` advances a matcher by the sampled token, and the
engine drops the matcher when its sequence finishes or is aborted. Branches of n > 1 each get
their own matcher at the start state (they fork before their first token); beam search is
refused by SamplingParams.

A value must parse even when the model would write on past max_tokens (a small model can add
keys until the budget runs out): `Constraint` follows the nesting its sequence has written, and
once the tokens left are about what closing it takes, `mask` keeps only tokens that close
(quotes, `}`, `]`, the key separator) wherever the grammar allows one.
"""
from __future__ import annotations

import threading

import llguidance
import torch

from kvreplay.sampling import apply_token_bitmask

# One-line JSON with a space after ':' and ',': a small model given free whitespace can emit
# newlines until max_tokens runs out, leaving an unfinished value.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(response_format: dict) -> str:
    """The llguidance grammar of a checked `response_format` (sampling.check_response_format);
    ValueError naming what is wrong with a schema llguidance cannot compile."""
    if response_format["type"] == "json_object":
        schema, where = {"type": "object"}, "response_format"
    else:
        schema, where = response_format["json_schema"]["schema"], "response_format.json_schema.schema"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{where} is not a schema this server can enforce: {error.splitlines()[0]}")
    return grammar


# Bytes of the tokens that finish a value: none opens a container or starts another item.
_CLOSING_BYTES = frozenset(b'"}] :')


class Constraint:
    """A sequence's structured-output state: its llguidance matcher, and the JSON nesting of what
    it has written (open containers, inside a string, after a backslash), from which
    `closing_cost` bounds the tokens needed to finish the value."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def copy(self) -> "Constraint":
        twin = Constraint(self.matcher.deep_copy())
        twin.depth, twin.in_string, twin.escaped = self.depth, self.in_string, self.escaped
        return twin

    def feed(self, data: bytes) -> None:
        """Follow the bytes of an accepted token through JSON's strings and containers."""
        for byte in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:  # quote
                    self.in_string = False
            elif byte == 0x22:
                self.in_string = True
            elif byte in (0x7B, 0x5B):  # { [
                self.depth += 1
            elif byte in (0x7D, 0x5D):  # } ]
                self.depth -= 1

    def closing_cost(self) -> int:
        """Tokens that surely finish the value from here: the innermost level may be inside a
        key (close it, the separator, an empty string value, the brace: at most 6 tokens), each
        level outside it needs its bracket."""
        return self.depth + 6


class Grammars:
    """The engine's structured-output state: the tokenizer as llguidance sees it (built on first
    use, ~1 s for a 49K vocabulary) and one mask buffer reused every step. The matchers themselves live on the sequences (`Sequence.grammar`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._bitmask = torch.empty(0, dtype=torch.int32)
        self._closing: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def constraint(self, response_format: dict) -> Constraint:
        """A fresh matcher at the grammar's start; ValueError for a schema it cannot enforce."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(response_format), log_level=0)
        if matcher.is_error():
            raise ValueError(f"response_format cannot be enforced: {matcher.get_error().splitlines()[0]}")
        return Constraint(matcher)

    def _closing_masks(self, words: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bitmasks [words] of the tokens made only of closing bytes: every such token, and those
        that start with a quote (inside a string only a quote closes; a space would not)."""
        if self._closing is None or self._closing[0].shape[0] != words:
            tokenizer = self._llg_tokenizer()
            closing = torch.zeros(words * 32, dtype=torch.bool)
            quoted = torch.zeros(words * 32, dtype=torch.bool)
            for token in range(min(tokenizer.vocab_size, words * 32)):
                data = tokenizer.decode_bytes([token])
                if data and all(byte in _CLOSING_BYTES for byte in data):
                    closing[token] = True
                    quoted[token] = data[0] == 0x22
            self._closing = (_pack_bits(closing), _pack_bits(quoted))
        return self._closing

    @torch.inference_mode()  # the step's logits are inference tensors: changed in place here
    def mask(self, logits: torch.Tensor, rows: list[int], constraints: list[Constraint],
             tokens_left: list[int]) -> None:
        """In place: -inf in logits [S, V] at the tokens each constrained row's grammar forbids
        next (`rows[i]` is the row of `constraints[i]`, which may write `tokens_left[i]` more
        tokens); a row whose tokens left no longer exceed its closing cost keeps only closing
        tokens, where its grammar allows any."""
        words = (logits.shape[1] + 31) // 32
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(len(rows), 1), words, dtype=torch.int32)
        bitmask = self._bitmask[:len(rows)]  # [R, words]
        # On the engine thread, one row after another (~40 us a row): llguidance's thread pool
        # (LLExecutor) keeps its threads spinning after the masks, and the next forward's threads
        # then share the cores with them (a batch-32 step took 1.6x as long).
        for i, constraint in enumerate(constraints):
            constraint.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
            if tokens_left[i] <= constraint.closing_cost() and not constraint.escaped:
                closing, quoted = self._closing_masks(words)
                narrowed = bitmask[i] & (quoted if constraint.in_string else closing)
                if bool(narrowed.any()):
                    bitmask[i] = narrowed
        if len(rows) == logits.shape[0]:
            apply_token_bitmask(logits, bitmask)
            return
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        picked = logits[index].contiguous()  # [R, V]
        apply_token_bitmask(picked, bitmask)
        logits[index] = picked

    def accept(self, constraint: Constraint, token: int) -> bool:
        """Advance by the sampled token; True when the grammar is complete (the value is done,
        or EOS was taken), so the sequence ends here."""
        matcher = constraint.matcher
        if not matcher.consume_token(token):
            raise AssertionError(f"token {token} was sampled outside its grammar: "
                                 f"{matcher.get_error().splitlines()[0]}")
        constraint.feed(self._llg_tokenizer().decode_bytes([token]))
        return matcher.is_stopped()


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """Booleans [32 * W] as llguidance's bitmask layout: int32 words [W], token t at bit t % 32
    of word t // 32."""
    bits = flags.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
