"""RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), written anew for kvreplay: seeded, generated offline with the
model's own tokenizer, each prompt exactly (needle tasks) or within a few tokens (word lists) of
the asked length, the whole chat-templated prompt counted.

| task | haystack | what is asked |
|---|---|---|
| niah_single_1 / _2 / _3 | noise sentences / Python docs prose / UUID-keyed records | one number for a word key (a UUID key in _3) |
| niah_multikey | prose, 3 distractor needles with other keys | one number for one of 4 keys |
| niah_multivalue | prose | all 4 numbers given for one key |
| niah_multiquery | prose | the numbers of 4 keys at once |
| vt | noise | every variable of a 4-hop chain `VAR B = VAR A` that holds a value |
| cwe | a numbered word list | the 10 words that appear most often (30x against 3x at 4K) |
| fwe | coded words, Zipf-distributed (alpha 2) | the 3 most frequent coded words |

The assistant's turn opens with an answer prefix ("The special magic number for X mentioned in
the provided text is"), as RULER does, so that a small model answers in place; where several
answers are asked (multi-value, multi-query, vt, cwe) it opens like the first of them, since
SmolLM2-135M asked for a list otherwise writes bullets of the nearby text.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvreplay.bench.ruler_text import (Needle, Prompt, TextKit, coded_word, distinct, number_value,
                                       uuid_key, variable_name, word_key)

NIAH_INSTRUCTION = ("Some special magic numbers are hidden in the long text below. Memorize them: "
                    "you will be asked about them afterwards.\n\n")


@dataclass(frozen=True)
class TaskInfo:
    """How a task is built and answered: greedy tokens it may write, the shortest prompt it fits."""
    max_tokens: int
    min_length: int


TASKS: dict[str, TaskInfo] = {
    "niah_single_1": TaskInfo(16, 256), "niah_single_2": TaskInfo(16, 256),
    "niah_single_3": TaskInfo(16, 256), "niah_multikey": TaskInfo(16, 384),
    "niah_multivalue": TaskInfo(48, 384), "niah_multiquery": TaskInfo(48, 384),
    "vt": TaskInfo(32, 384), "cwe": TaskInfo(64, 512), "fwe": TaskInfo(32, 512),
}


@dataclass
class RulerCase:
    """One prompt and what its answer must contain (RULER scores `string_match_all`)."""
    task: str
    length: int
    index: int
    prompt_token_ids: list[int]
    references: list[str]
    needles: list[Needle]
    max_tokens: int
    query: str = ""
    question_start: int = 0  # the context is prompt_token_ids[:question_start]; the question follows


def case_seed(seed: int, task: str, length: int, index: int) -> int:
    """Each case its own stream: adding a task or a case leaves the others unchanged."""
    return random.Random(f"{seed}/{task}/{length}/{index}").getrandbits(63)


def make_case(kit: TextKit, task: str, length: int, index: int, seed: int) -> RulerCase:
    rng = random.Random(case_seed(seed, task, length, index))
    build = {"niah_single_1": lambda: _niah(kit, rng, length, "noise", word_key),
             "niah_single_2": lambda: _niah(kit, rng, length, "prose", word_key),
             "niah_single_3": lambda: _niah(kit, rng, length, "uuid", uuid_key),
             "niah_multikey": lambda: _niah(kit, rng, length, "prose", word_key, num_keys=4),
             "niah_multivalue": lambda: _niah(kit, rng, length, "prose", word_key, num_values=4),
             "niah_multiquery": lambda: _niah(kit, rng, length, "prose", word_key, num_keys=4,
                                              num_queries=4),
             "vt": lambda: _variable_tracking(kit, rng, length),
             "cwe": lambda: _common_words(kit, rng, length),
             "fwe": lambda: _frequent_words(kit, rng, length)}[task]
    prompt, references, query = build()
    return RulerCase(task, length, index, prompt.token_ids, references, prompt.needles,
                     TASKS[task].max_tokens, query, prompt.question_start)


def _single_turn(kit: TextKit, instruction: str, question: str, answer_prefix: str, length: int,
                 body) -> Prompt:
    """template(user: instruction + body + question) + answer prefix; `body(prompt, tokens)`
    appends the rest of the length."""
    before, after = kit.frame(1)
    head = before + kit.encode(instruction)
    tail = kit.encode(question) + after + kit.encode(answer_prefix)
    prompt = Prompt()
    prompt.add(head)
    body(prompt, length - len(head) - len(tail))
    prompt.question_start = len(prompt.token_ids)
    prompt.add(tail)
    return prompt


def _listing(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _niah(kit: TextKit, rng: random.Random, length: int, hay_kind: str, key_draw,
          num_keys: int = 1, num_values: int = 1, num_queries: int = 1):
    keys = distinct(key_draw, rng, num_keys)
    values = distinct(number_value, rng, num_keys * num_values)
    facts = [(keys[i // num_values], values[i]) for i in range(len(values))]
    rng.shuffle(facts)
    asked = keys[:num_queries]
    many = num_values > 1 or num_queries > 1
    template = (" One of the special magic numbers for {} is {}." if num_values > 1 else
                " The special magic number for {} is {}.")
    texts = [template.format(key, value) for key, value in facts]
    needles = list(zip(texts, kit.encode_many(texts)))
    depths = sorted(rng.uniform(0.02, 0.98) for _ in needles)
    noun = "numbers" if many else "number"
    question = (f"\n\nWhat {'are all' if num_values > 1 else 'are' if many else 'is'} the special "
                f"magic {noun} for {_listing(asked)} mentioned in the text above?")
    # Several answers: the answer opens like a needle about the first one asked, since a small
    # model (SmolLM2-135M) asked to list them writes a bullet list of the nearby prose instead.
    prefix = (template.format(asked[0], "").strip()[:-1].rstrip() if many else
              f"The special magic number for {asked[0]} mentioned in the provided text is")

    def body(prompt: Prompt, tokens: int) -> None:
        hay = kit.haystack(hay_kind, tokens - sum(len(ids) for _, ids in needles), rng)
        kit.plant(prompt, hay, needles, depths)

    prompt = _single_turn(kit, NIAH_INSTRUCTION, question, prefix, length, body)
    references = [value for key in asked for k, value in facts if k == key]
    return prompt, references, _listing(asked)


def _variable_tracking(kit: TextKit, rng: random.Random, length: int, num_hops: int = 4):
    names = distinct(variable_name, rng, num_hops + 1)
    value = number_value(rng, 5)
    texts = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}."
                                                for i in range(1, len(names))]
    needles = list(zip(texts, kit.encode_many(texts)))
    depths = sorted(rng.uniform(0.02, 0.98) for _ in needles)
    question = (f"\n\nQuestion: Which variables in the text above hold the value {value}, "
                f"assigned directly or through other variables? Name them all.")
    # opened like an assignment: asked for a list, a small model numbers lines of made-up prose
    prefix = (f"Answer: Following the chain of assignments, the variables that hold the value "
              f"{value} are: VAR")

    def body(prompt: Prompt, tokens: int) -> None:
        hay = kit.haystack("noise", tokens - sum(len(ids) for _, ids in needles), rng)
        kit.plant(prompt, hay, needles, depths)

    instruction = ("Memorize the variable assignments hidden in the text below: you will be asked "
                   "about them afterwards.\n\n")
    return _single_turn(kit, instruction, question, prefix, length, body), names, value


def _fit(build, budget: int, high: int) -> tuple[int, list[int]]:
    """(n, build(n)) for the largest n in [0, high] whose `build(n)` (token ids, growing with
    n) fits in `budget` tokens."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        if len(build(middle)) <= budget:
            low = middle
        else:
            high = middle - 1
    return low, build(low)


def _common_words(kit: TextKit, rng: random.Random, length: int, num_common: int = 10):
    """A numbered list where `num_common` words appear many times and the rest a few times."""
    freq_common = max(4, min(30, length // 140))
    freq_rare = 3 if freq_common >= 8 else 2
    pool = list(kit.words())
    rng.shuffle(pool)
    common: list[str] = []
    rare: list[str] = []
    for word in pool:  # no chosen word inside another, so a match counts one word only
        if any(word in w or w in word for w in common + rare):
            continue
        (common if len(common) < num_common else rare).append(word)
        if len(rare) >= length // 2:
            break
    order_seed = rng.getrandbits(32)

    def build(num_rare: int) -> list[int]:  # rare entries one at a time: the length comes close
        entries = common * freq_common + (rare * freq_rare)[:num_rare]
        random.Random(order_seed).shuffle(entries)
        return kit.encode("\n".join(f"{i}. {w}" for i, w in enumerate(entries, 1)))

    question = f"\n\nQuestion: Which {num_common} words appear most often in the list above?"
    # opened like the list itself: asked plainly, a small model writes bullets of numbers
    prefix = f"Answer: The {num_common} words that appear most often in the list are:\n1."
    instruction = "Below is a numbered list of words. Some of the words appear many times.\n\n"
    prompt = _single_turn(kit, instruction, question, prefix, length,
                          lambda p, tokens: p.add(_fit(build, tokens, len(rare) * freq_rare)[1]))
    return prompt, common, ""


def _frequent_words(kit: TextKit, rng: random.Random, length: int, top: int = 3):
    """Coded words whose counts follow Zipf's law with exponent 2 (rank r: ~61% / r^2 of the
    text); the `top` most frequent are asked, and their counts are strictly apart."""
    vocabulary = distinct(coded_word, rng, max(64, length // 2))
    order_seed = rng.getrandbits(32)

    def counts(num_words: int) -> list[int]:
        head = [int(num_words * 0.6079 / r ** 2) for r in range(1, len(vocabulary) + 1)]
        head = [c for c in head if c > 1]
        return (head + [1] * max(0, num_words - sum(head)))[:len(vocabulary)]

    def build(num_words: int) -> list[int]:
        words = [w for w, c in zip(vocabulary, counts(num_words)) for _ in range(c)]
        random.Random(order_seed).shuffle(words)
        lines = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
        return kit.encode("\n".join(lines))

    question = f"\n\nQuestion: Which {top} coded words occur most often in the coded text above?"
    prefix = f"Answer: The {top} most frequent coded words in the text are:"
    instruction = "Read the coded text below and count how often each coded word occurs.\n\n"

    def body(prompt: Prompt, tokens: int) -> None:
        num_words, ids = _fit(build, tokens, 4 * length)
        ranked = counts(num_words)
        if not all(ranked[i] > ranked[i + 1] for i in range(top)):
            raise ValueError(f"fwe: {length} tokens hold too few words to rank the top {top}: "
                             f"ask for a longer length")
        prompt.add(ids)

    prompt = _single_turn(kit, instruction, question, prefix, length, body)
    return prompt, vocabulary[:top], ""
