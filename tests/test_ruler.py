"""The RULER-style suite: seeded generation checked (needles where the case says, distractors and
answers distinct, lengths as asked), the scoring, bad arguments, and one small end-to-end run."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from kvreplay.bench.ruler import RulerSpec, plan_runs
from kvreplay.bench.ruler_multiturn import ROUNDS, make_multiturn_case, next_turn, round_prompt
from kvreplay.bench.ruler_tasks import TASKS, make_case
from kvreplay.bench.ruler_text import TextKit, string_match_all
from kvreplay.config import EngineConfig

NEEDLE_TASKS = [t for t in TASKS if t.startswith("niah") or t == "vt"]


@pytest.fixture(scope="module")
def kit():
    from kvreplay.models.loader import load_tokenizer
    return TextKit(load_tokenizer(None))


def test_generation_is_seeded_and_reproducible(kit):
    for task in TASKS:
        first, again = make_case(kit, task, 1024, 3, seed=7), make_case(kit, task, 1024, 3, seed=7)
        assert first == again, task
        other = make_case(kit, task, 1024, 3, seed=8)
        assert other.prompt_token_ids != first.prompt_token_ids, task
        assert make_case(kit, task, 1024, 4, seed=7).references != first.references, task


@pytest.mark.parametrize("length", [600, 1024, 3000])
def test_lengths_are_the_asked_ones(kit, length):
    for task in TASKS:
        case = make_case(kit, task, length, 0, seed=0)
        if task in NEEDLE_TASKS:
            assert len(case.prompt_token_ids) == length, task
        else:  # word lists grow one entry (a few tokens) at a time
            assert length - 8 <= len(case.prompt_token_ids) <= length, task


def test_needles_are_where_the_case_says(kit):
    for task in NEEDLE_TASKS:
        for index in range(3):
            case = make_case(kit, task, 1024, index, seed=0)
            assert case.needles, task
            for needle in case.needles:
                assert kit.decode(case.prompt_token_ids[needle.start:needle.end]) == needle.text
            text = " ".join(n.text for n in case.needles)
            assert all(ref in text for ref in case.references), (task, case.references)
            starts = [n.start for n in case.needles]
            assert starts == sorted(starts) and starts[0] > 20 and case.needles[-1].end < 1024 - 20
    case = make_case(kit, "niah_single_2", 1024, 0, seed=0)
    value = case.references[0]
    decoded = kit.decode(case.prompt_token_ids)
    assert decoded.count(value) == 1 and case.query in decoded.split("text above?")[1]
    assert decoded.endswith(f"The special magic number for {case.query} mentioned in the provided text is")


def _keys(case) -> list[str]:
    return [re.search(r"numbers? for (\S+) is", n.text).group(1) for n in case.needles]


def test_multikey_distractors_differ_and_answers_are_unique(kit):
    for index in range(5):
        case = make_case(kit, "niah_multikey", 1024, index, seed=0)
        keys = _keys(case)
        assert len(keys) == 4 and len(set(keys)) == 4 and keys.count(case.query) == 1
        asked = next(n.text for n in case.needles if f" {case.query} " in n.text)
        assert case.references == [asked.split()[-1].rstrip(".")]
        values = [n.text.split()[-1] for n in case.needles]
        assert len(set(values)) == 4
        single3 = make_case(kit, "niah_single_3", 1024, index, seed=0)
        assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", single3.query)
        multivalue = make_case(kit, "niah_multivalue", 1024, index, seed=0)
        assert set(_keys(multivalue)) == {multivalue.query} and len(set(multivalue.references)) == 4
        multiquery = make_case(kit, "niah_multiquery", 1024, index, seed=0)
        assert len(set(_keys(multiquery))) == 4 and len(set(multiquery.references)) == 4
        vt = make_case(kit, "vt", 1024, index, seed=0)
        assert len(set(vt.references)) == 5
        chain = [re.match(r" VAR (\w+) = (.+)\.", n.text).groups() for n in vt.needles]
        assert [name for name, _ in chain] == vt.references         # in order, each from the last
        assert all(chain[i][1] == f"VAR {chain[i - 1][0]}" for i in range(1, 5))


def test_word_tasks_rank_their_answers_apart(kit):
    for length in (512, 4096):
        cwe = make_case(kit, "cwe", length, 0, seed=0)
        words = re.findall(r"^\d+\. (\w+)$", kit.decode(cwe.prompt_token_ids), flags=re.M)
        counts = Counter(words)
        common = {w for w, _ in counts.most_common(10)}
        assert common == set(cwe.references)
        assert min(counts[w] for w in common) > max(c for w, c in counts.items() if w not in common)
        fwe = make_case(kit, "fwe", length, 0, seed=0)
        text = kit.decode(fwe.prompt_token_ids).split("occurs.\n\n")[1].split("\n\nQuestion")[0]
        ranked = Counter(text.split()).most_common(4)
        assert [w for w, _ in ranked[:3]] == fwe.references
        assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]


def test_multiturn_case(kit):
    case = make_multiturn_case(kit, 1024, 0, seed=0)
    assert len(set(case.keys)) == ROUNDS and len(set(case.values)) == ROUNDS
    first = round_prompt(kit, case, 0, [])
    assert len(first) == 1024
    quarters = set()
    for needle in case.needles:
        assert kit.decode(first[needle.start:needle.end]) == needle.text
        quarters.add(int(4 * needle.start / 1024))
    assert quarters == {0, 1, 2, 3}                             # one fact per quarter
    assert len({kind.fact for kind in case.kinds}) == ROUNDS    # each worded its own way
    texts = {needle.text for needle in case.needles}
    for r in range(ROUNDS):  # round r asks the fact its key and kind planted, in its own words
        assert case.kinds[r].fact.format(key=case.keys[r], value=case.values[r]) in texts
        assert case.keys[r] in case.question(r) and case.keys[r] in case.answer_prefix(r)
    assert len({case.question(r).strip().split()[0] for r in range(ROUNDS)}) > 1
    last = round_prompt(kit, case, 3, ["1", "2", "3"])
    assert last[:len(case.document)] == case.document and len(last) < 1024 + 256
    text = kit.decode(last)
    assert text.count("<|im_start|>assistant") == 4 and text.count("<|im_start|>user") == 4
    assert text.endswith(case.answer_prefix(3))
    for r in range(3):
        assert f"{case.answer_prefix(r)} {r + 1}<|im_end|>" in text


def test_a_kept_rounds_next_turn_is_the_rest_of_the_next_prompt(kit):
    case = make_multiturn_case(kit, 1024, 1, seed=0)
    chat = round_prompt(kit, case, 0, [])
    for r in range(1, ROUNDS):
        chat = chat + kit.encode(f" {r}") + next_turn(kit, case, r)
        assert kit.decode(chat) == kit.decode(round_prompt(kit, case, r, [str(i) for i in range(1, r + 1)]))


def test_multiturn_keeps_each_chats_kv_across_rounds(tiny_model):
    """Rounds 2-4 prefill only their new turn: full reuses everything, snapkv keeps its holes
    (no replay), replay brings its dropped middle back before each new turn."""
    from kvreplay.bench.ruler import ruler_suite
    spec = RulerSpec(tasks=("multiturn",), lengths=(768,), cases=2, ratios=(0.25,))
    result = ruler_suite(EngineConfig(model=tiny_model, dtype="float32"), spec,
                         ["full", "snapkv", "replay"], progress=False)
    runs = {run["policy"]: run["tasks"]["multiturn"]["768"]["cases"] for run in result["runs"]}
    for policy, rows in runs.items():
        assert [row["round"] for row in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
        first, later = rows[:2], rows[2:]
        assert all(row["stats"]["prefix_hit_tokens"] == 0 for row in first)
        assert all(0 < row["prompt_tokens"] - row["stats"]["prefix_hit_tokens"] < 64 for row in later), policy
    assert all(row["stats"]["dropped_tokens"] > 0 for row in runs["snapkv"][:2])
    assert all(row["stats"]["replays"] == 0 for row in runs["snapkv"] + runs["full"])
    assert all(row["stats"]["replays"] >= 1 for row in runs["replay"][2:])


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 100.0
    assert string_match_all(" is 1234567.", ["7654321"]) == 0.0
    assert string_match_all("apple, Banana, cherry", ["APPLE", "banana", "kiwi", "plum"]) == 50.0


def test_bad_spec_values_are_clear_errors():
    with pytest.raises(ValueError, match="niah_single_1"):
        RulerSpec(tasks=("niah_bogus",))
    with pytest.raises(ValueError, match="at least 512 tokens"):
        RulerSpec(tasks=("cwe",), lengths=(300,))
    with pytest.raises(ValueError, match="--cases must be at least 1"):
        RulerSpec(cases=0)
    for ratios in ((0.0,), (1.5,), ()):
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            RulerSpec(ratios=ratios)
    with pytest.raises(ValueError, match="at most"):
        RulerSpec(lengths=(8192,)).check_context(8192)
    with pytest.raises(ValueError, match="--policies takes names from"):
        plan_runs(["full", "nope"], (0.5,))
    assert plan_runs(["full", "window", "replay"], (0.1, 0.5)) == [
        ("full", None), ("window", 0.1), ("window", 0.5), ("replay", 0.1), ("replay", 0.5)]


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "niah_single_1,bogus"], "--tasks takes"),
    (["--lengths", "128"], "raise it or leave"),
    (["--lengths", "9000"], "lengths of at most"),
    (["--cases", "0"], "--cases must be at least 1"),
    (["--ratios", "0.1,1.5"], "in (0, 1]"),
    (["--policies", "full,bogus"], "--policies takes"),
    (["--budgets", "64MiB"], "--ratios"),
])
def test_bad_cli_arguments_fail_before_any_model_work(argv, message, capsys):
    from kvreplay.cli import main
    assert main(["bench", "quality", "--suite", "ruler", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_end_to_end(tmp_path, capsys):
    from kvreplay.cli import main
    paths = {name: tmp_path / f"ruler.{name}" for name in ("json", "md", "png")}
    assert main(["bench", "quality", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "512",
                 "--cases", "1", "--policies", "full", "--no-progress", "--json", str(paths["json"]),
                 "--markdown", str(paths["md"]), "--plot", str(paths["png"])]) == 0
    printed = capsys.readouterr().out
    assert "| niah_single_1 |" in printed and "| **average** |" in printed
    assert paths["md"].read_text().strip() == printed.strip()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(paths["json"].read_text())
    run, = result["runs"]
    assert (run["policy"], run["ratio"]) == ("full", None)
    cell = run["tasks"]["niah_single_1"]["512"]
    case, = cell["cases"]
    assert case["score"] in (0.0, 100.0) and cell["score"] == case["score"]
    assert case["resident_mean"] == pytest.approx(1.0, abs=0.05)    # full keeps every block
    assert case["stats"]["replays"] == 0 and case["stats"]["dropped_tokens"] == 0
    assert run["lengths"]["512"]["average"] == case["score"]


def test_runs_above_their_ratio_are_named():
    from kvreplay.bench.ruler import over_ratio
    run = {"ratio": 0.1, "lengths": {"4096": {"resident_mean": 0.13}, "7680": {"resident_mean": 1.0}}}
    assert over_ratio(run) == ["7680"]                  # a preset that ignored resident_ratio
    assert over_ratio({"ratio": None, "lengths": {"4096": {"resident_mean": 1.0}}}) == []


def test_context_first_cuts_before_the_question_and_full_writes_the_same_answers(kit, tiny_model):
    """--context-first: the question starts where the case says; each case runs as a kept
    context then the whole prompt. Under full the answers are the one-request answers (the kept
    KV is exact); SnapKV cut the context before the question (its blocks are gone when the
    question comes: no drop in the second request)."""
    from kvreplay.bench.ruler import ruler_suite
    for task in TASKS:
        case = make_case(kit, task, 1024, 0, seed=0)
        assert 0 < case.question_start < len(case.prompt_token_ids)
        assert case.query in kit.decode(case.prompt_token_ids[case.question_start:]) or not case.query
        assert all(n.end <= case.question_start for n in case.needles), task
    config = EngineConfig(model=tiny_model, dtype="float32")
    results = {}
    for first in (False, True):
        spec = RulerSpec(tasks=("niah_single_2",), lengths=(768,), cases=3, ratios=(0.25,),
                         concurrent=2, context_first=first)
        results[first] = {run["label"]: run["tasks"]["niah_single_2"]["768"]["cases"] for run in
                          ruler_suite(config, spec, ["full", "snapkv"], progress=False)["runs"]}
    assert [r["output"] for r in results[True]["full"]] == [r["output"] for r in results[False]["full"]]
    for row in results[True]["snapkv@0.25"]:
        assert row["stats"]["prefix_hit_tokens"] > 0 and row["stats"]["dropped_tokens"] <= 16
        assert row["resident_first"] <= 0.3


def test_a_base_model_needs_a_chat_template_and_plain_frames_its_text():
    """Gemma 3 270M is a base model: no template of its own, a clear error before it loads;
    `--chat-template plain` frames the prompt as BOS + the text + a newline."""
    from kvreplay.bench.ruler import ruler_suite
    from kvreplay.models.loader import load_tokenizer
    with pytest.raises(ValueError, match="--chat-template plain"):
        ruler_suite(EngineConfig(model="gemma3-270m"), RulerSpec(tasks=("niah_single_1",), lengths=(4096,),
                                                                 cases=1), ["full"], progress=False)
    plain = TextKit(load_tokenizer("gemma3-270m", "plain"))
    before, after = plain.frame(1)
    assert before == [plain.tokenizer.bos_token_id] and plain.decode(after) == "\n"
    case = make_case(plain, "niah_single_2", 1024, 0, seed=0)
    assert case.prompt_token_ids[0] == plain.tokenizer.bos_token_id and len(case.prompt_token_ids) == 1024
