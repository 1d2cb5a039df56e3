"""The suite's multi-turn task: a 4-round chat over one long document (Python docs prose), one
fact planted in each quarter of it, a question per round about a different quarter, in a seeded
order. The four facts are of four kinds, each worded its own way (`FACTS`), so that a question
draws attention to its own fact rather than to every fact alike: a policy that chose what to keep
for the first question (SnapKV) is then measured on the later ones. Each round's prompt is the
whole chat so far: the document and the first question, then the earlier questions with the
answers the same policy gave, then the new question and its answer prefix. Each answer is
scored by string match against its fact's number.

The first round's prompt is exactly the asked length; later rounds add their questions and
answers (at most `EXTRA_TOKENS` in all).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvreplay.bench.ruler_tasks import case_seed
from kvreplay.bench.ruler_text import Needle, Prompt, TextKit, distinct, number_value, word_key

ROUNDS = 4
MAX_TOKENS = 16
EXTRA_TOKENS = 256
MIN_LENGTH = 512
INSTRUCTION = ("Some facts with numbers are hidden in the long text below. Memorize them: you will be "
               "asked about them afterwards.\n\n")


@dataclass(frozen=True)
class FactKind:
    """How one kind of fact is planted, asked and answered (`{key}`, `{value}` filled in)."""
    fact: str
    question: str
    answer_prefix: str


FACTS = (
    FactKind(" The special magic number for {key} is {value}.",
             "What is the special magic number for {key} mentioned in the text?",
             "The special magic number for {key} mentioned in the provided text is"),
    FactKind(" The {key} locker opens with the code {value}.",
             "Which code opens the {key} locker mentioned in the text?",
             "The code that opens the {key} locker mentioned in the provided text is"),
    FactKind(" The {key} parcel was shipped under tracking number {value}.",
             "What tracking number was the {key} parcel shipped under, as the text says?",
             "The tracking number of the {key} parcel mentioned in the provided text is"),
    FactKind(" The {key} meeting was moved to room {value}.",
             "Which room was the {key} meeting moved to in the text?",
             "The room the {key} meeting was moved to in the provided text is"),
)


@dataclass
class MultiTurnCase:
    """The document and its facts (`needles`, token offsets in every round's prompt: the
    document opens the chat) and, per round, the key asked, its value and its fact's kind."""
    length: int
    index: int
    document: list[int]          # the template's opening and the first user message's head
    needles: list[Needle]
    keys: list[str]              # asked in this order, one per round
    values: list[str]
    kinds: list[FactKind]
    task: str = "multiturn"
    max_tokens: int = MAX_TOKENS

    def question(self, round_index: int) -> str:
        lead = "\n\n" if round_index == 0 else ""
        return lead + self.kinds[round_index].question.format(key=self.keys[round_index])

    def answer_prefix(self, round_index: int) -> str:
        return self.kinds[round_index].answer_prefix.format(key=self.keys[round_index])


def make_multiturn_case(kit: TextKit, length: int, index: int, seed: int) -> MultiTurnCase:
    rng = random.Random(case_seed(seed, "multiturn", length, index))
    keys = distinct(word_key, rng, ROUNDS)
    values = distinct(number_value, rng, ROUNDS)
    kinds = list(FACTS)
    rng.shuffle(kinds)
    # fact q (of kind q) sits in quarter q of the document; the rounds ask the quarters in a seeded order
    texts = [kind.fact.format(key=k, value=v) for kind, k, v in zip(kinds, keys, values)]
    needles = list(zip(texts, kit.encode_many(texts)))
    depths = [rng.uniform(q / ROUNDS + 0.03, (q + 1) / ROUNDS - 0.03) for q in range(ROUNDS)]
    order = list(range(ROUNDS))
    rng.shuffle(order)
    case = MultiTurnCase(length, index, [], [], [keys[q] for q in order], [values[q] for q in order],
                         [kinds[q] for q in order])
    glue = kit.frame(1)
    prompt = Prompt()
    prompt.add(glue[0] + kit.encode(INSTRUCTION))
    tail = len(kit.encode(case.question(0)) + glue[1] + kit.encode(case.answer_prefix(0)))
    hay_tokens = length - len(prompt.token_ids) - tail - sum(len(ids) for _, ids in needles)
    kit.plant(prompt, kit.haystack("prose", hay_tokens, rng), needles, depths)
    case.document, case.needles = prompt.token_ids, prompt.needles
    return case


def round_prompt(kit: TextKit, case: MultiTurnCase, round_index: int, answers: list[str]) -> list[int]:
    """Token ids of round `round_index`'s prompt, given the answers of the earlier rounds."""
    glue = kit.frame(round_index + 1)
    assert glue[0] == kit.frame(1)[0], "the chat template opens a longer chat differently"
    ids = list(case.document)
    for r in range(round_index + 1):
        ids += kit.encode(case.question(r)) + glue[2 * r + 1]
        if r < round_index:
            ids += kit.encode(f"{case.answer_prefix(r)} {answers[r].strip()}") + glue[2 * r + 2]
    return ids + kit.encode(case.answer_prefix(round_index))


def next_turn(kit: TextKit, case: MultiTurnCase, round_index: int) -> list[int]:
    """Token ids that follow round `round_index - 1`'s answer in round `round_index`'s prompt:
    the template's glue, the new question, the opening of the assistant's turn, its answer
    prefix (a kept session's next round: `round_prompt` less what the chat holds already)."""
    glue = kit.frame(round_index + 1)
    return (glue[2 * round_index] + kit.encode(case.question(round_index)) + glue[2 * round_index + 1]
            + kit.encode(case.answer_prefix(round_index)))
