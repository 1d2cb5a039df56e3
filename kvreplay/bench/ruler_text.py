"""Building blocks of the RULER-style suite (kvreplay/bench/ruler_tasks.py): the chat frame,
haystacks, planted needles with their token offsets, key and value draws, and the scoring.

Every prompt is assembled from token ids, not from one rendered string, so that its length is
counted in the model's own tokens and each needle's token span is known exactly: pieces (the
chat template's glue, the instruction, haystack slices, needles, the question, the answer
prefix) are encoded one by one and concatenated. Decoding a recorded span gives the needle's
text back (byte-level BPE round-trips), which is what the tests check.
"""
from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field

# Filler for the `noise` haystack: short sentences that carry no fact, repeated.
NOISE = (" The hills stay green all year. The lake is calm in the morning. A cart rolls down the"
         " lane. The baker opens at dawn. Clouds pass over the valley and rain falls again.")
ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy",
              "jolly", "keen", "lucky", "mellow", "narrow", "olive", "proud", "quiet", "rapid",
              "silent", "tidy", "upper", "vivid", "wooden", "young", "zesty", "bold", "crisp",
              "distant", "golden", "humble")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island",
         "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry",
         "rabbit", "saddle", "tunnel", "violin", "walnut", "window", "bridge", "cellar", "ferry",
         "glacier", "hammer", "mirror", "pillow")


@dataclass
class Needle:
    """A planted fact: its text and its [start, end) token offsets in the prompt."""
    text: str
    start: int
    end: int


@dataclass
class Prompt:
    """Token ids assembled piece by piece, with the offsets of the needles placed so far."""
    token_ids: list[int] = field(default_factory=list)
    needles: list[Needle] = field(default_factory=list)
    question_start: int | None = None  # where the question opens (the context ends)

    def add(self, ids: list[int]) -> None:
        self.token_ids.extend(ids)

    def add_needle(self, text: str, ids: list[int]) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.needles.append(Needle(text, start, len(self.token_ids)))


class TextKit:
    """The tokenizer-bound helpers one suite run shares: encoding, the chat frame, haystacks."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._corpus: list[int] | None = None
        self._words: list[str] | None = None
        self._frames: dict[int, list[list[int]]] = {}
        self._ends: dict[int, int] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def frame(self, num_users: int) -> list[list[int]]:
        """The chat template's glue around a chat of `num_users` user turns, each but the last
        answered, with the generation prompt at the end: 2 * num_users token lists, the glue
        before each message and, last, the glue that opens the assistant's turn."""
        if num_users not in self._frames:
            marks = [f"\x00{i}\x00" for i in range(2 * num_users - 1)]
            chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": m}
                    for i, m in enumerate(marks)]
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            glue = re.split("|".join(re.escape(m) for m in marks), text)
            assert len(glue) == len(marks) + 1, "the chat template repeats or drops a message"
            self._frames[num_users] = self.encode_many(glue)
        return self._frames[num_users]

    # ------------------------------------------------------------------ haystacks
    def corpus(self) -> list[int]:
        """Real prose: CPython's reference docs (pydoc_data.topics), tokenized once."""
        if self._corpus is None:
            from kvreplay.bench.workload import corpus_token_ids
            self._corpus = corpus_token_ids(self.tokenizer)
        return self._corpus

    def haystack(self, kind: str, num_tokens: int, rng: random.Random) -> list[int]:
        """`num_tokens` of filler: `noise` sentences repeated, `prose` from the Python docs at a
        seeded offset, or `uuid` lines of keys that hold nothing."""
        if num_tokens <= 0:
            return []
        if kind == "noise":
            unit = self.encode(NOISE)
            return (unit * (num_tokens // len(unit) + 1))[:num_tokens]
        if kind == "prose":
            corpus = self.corpus()
            if num_tokens >= len(corpus):
                raise ValueError(f"the prose corpus has {len(corpus):,} tokens; {num_tokens:,} were asked for")
            offset = rng.randrange(len(corpus) - num_tokens)
            return corpus[offset:offset + num_tokens]
        if kind == "uuid":
            ids: list[int] = []
            while len(ids) < num_tokens:
                lines = [f"\nRecord {uuid_key(rng)} is archived." for _ in range(64)]
                for piece in self.encode_many(lines):
                    ids.extend(piece)
            return ids[:num_tokens]
        raise AssertionError(f"unknown haystack {kind!r}")

    def _boundary(self, token_id: int) -> int:
        """2 for a token that ends a line, 1 for one that ends a sentence, else 0."""
        if token_id not in self._ends:
            text = self.decode([token_id]).rstrip(" ")
            self._ends[token_id] = 2 if text.endswith("\n") else int(text.endswith((".", ":")))
        return self._ends[token_id]

    def snap(self, hay: list[int], position: int, reach: int = 64) -> int:
        """The line end nearest to `position` within `reach` tokens, else the nearest sentence
        end, else `position` itself: a needle planted there splits no sentence."""
        for level in (2, 1):
            for delta in range(reach + 1):
                for p in (position - delta, position + delta):
                    if 0 < p < len(hay) and self._boundary(hay[p - 1]) == level:
                        return p
        return position

    def plant(self, prompt: Prompt, hay: list[int], needles: list[tuple[str, list[int]]],
              depths: list[float]) -> None:
        """Append `hay` to `prompt` with each needle inserted at its depth (a fraction of the
        haystack, snapped to a sentence boundary); needles keep their order."""
        cuts = [self.snap(hay, round(d * len(hay))) if 0 < d < 1 else round(d * len(hay)) for d in depths]
        cuts = [max(c, cuts[i - 1]) if i else c for i, c in enumerate(cuts)]
        last = 0
        for (text, ids), cut in zip(needles, cuts):
            prompt.add(hay[last:cut])
            prompt.add_needle(text, ids)
            last = cut
        prompt.add(hay[last:])

    # ------------------------------------------------------------------ words
    def words(self) -> list[str]:
        """Distinct words of the Python docs (5-9 lowercase letters, seen at least 5 times), sorted."""
        if self._words is None:
            from pydoc_data.topics import topics
            found = Counter(re.findall(r"\b[a-z]{5,9}\b", " ".join(topics.values())))
            self._words = sorted(word for word, count in found.items() if count >= 5)
        return self._words


def word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def uuid_key(rng: random.Random) -> str:
    hex_digits = "0123456789abcdef"
    return "-".join("".join(rng.choice(hex_digits) for _ in range(n)) for n in (8, 4, 4, 4, 12))


def number_value(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def distinct(draw, rng: random.Random, count: int, avoid: set[str] = frozenset()) -> list[str]:
    """`count` different draws of `draw(rng)`, none in `avoid`."""
    seen: list[str] = []
    while len(seen) < count:
        value = draw(rng)
        if value not in seen and value not in avoid:
            seen.append(value)
    return seen


def variable_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def coded_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(5))


# ---------------------------------------------------------------------- scoring
def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's metric for one case: the share of reference strings found in the prediction,
    case-insensitive, times 100."""
    text = prediction.lower()
    return 100.0 * sum(ref.lower() in text for ref in references) / len(references)
