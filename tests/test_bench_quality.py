"""The quality bench: full-attention scoring, the fidelity arithmetic, retrieval cases, a smoke run."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvreplay.bench.quality import QualitySpec, retrieval_cases, run_fidelity, run_retrieval
from kvreplay.bench.scoring import FullAttentionScorer, compare_continuation
from bench_helpers import shared_corpus, shared_llm


@pytest.fixture(scope="module")
def small_llm():
    return shared_llm()


@pytest.fixture(scope="module")
def corpus(small_llm):
    return list(shared_corpus())


def test_compare_continuation_arithmetic():
    # full attention's log-probs at 3 steps over a 4-token vocabulary
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.2, 0.5, 0.2, 0.1], [0.25, 0.25, 0.4, 0.1]])
    reference = probs.log()
    tokens = [0, 2, 2]                       # agrees at steps 0 and 2, not at 1
    same = [{t: math.log(probs[i, t].item()) for t in range(4)} for i in range(3)]
    result = compare_continuation(reference, tokens, same)
    assert result["top1_agreement"] == pytest.approx(2 / 3)
    assert result["matching_prefix"] == 1
    assert result["kl"] == pytest.approx(0.0, abs=1e-6)
    # policy top-1 only, step 0: p = {0: 0.9}, rest 0.1; full: 0.7 / 0.3
    top1 = [{0: math.log(0.9)}]
    expected = 0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3)
    assert compare_continuation(reference[:1], [0], top1)["kl"] == pytest.approx(expected)


def test_scorer_matches_the_engine_and_is_chunk_invariant(small_llm, corpus):
    from kvreplay import SamplingParams
    ids = corpus[:64]
    out = small_llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    token = out.token_ids[0]
    chunked = FullAttentionScorer(small_llm.engine.model, chunk_tokens=40)
    logprobs = chunked.logprobs_at(ids, list(range(64)))           # every position, in 2 chunks
    assert int(logprobs[63].argmax()) == token                      # what follows the whole prompt
    assert logprobs[63, token].item() == pytest.approx(out.logprobs[0][token], abs=1e-4)
    whole = FullAttentionScorer(small_llm.engine.model, chunk_tokens=512)
    nll = -logprobs[:63].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert whole.perplexity(ids) == pytest.approx(math.exp(nll), rel=1e-5)


def test_full_against_full_attention_agrees_exactly(small_llm, corpus):
    spec = QualitySpec(fidelity_prompts=2, fidelity_context=64, fidelity_tokens=5)
    result = run_fidelity(small_llm, FullAttentionScorer(small_llm.engine.model), corpus, spec, False)
    assert result["top1_agreement"] == 1.0 and result["matching_prefix"] == 5
    assert result["kl"] < 1e-6
    small_llm.engine.check_integrity()


def test_retrieval_cases_and_scoring(small_llm, corpus):
    spec = QualitySpec(lengths=(96,), depths=(0.0, 1.0), cases=1)
    cases = retrieval_cases(small_llm.tokenizer, corpus, spec)
    assert [c.depth for c in cases] == [0.0, 1.0]
    for case in cases:
        assert len(case.prompt_token_ids) == 96 and len(case.answer) == 5
        text = small_llm.tokenizer.decode(case.prompt_token_ids)
        assert f"is {case.answer}." in text and text.endswith("is")
    assert text.index(case.answer) > text.index("Question") - 40     # depth 1.0: just before it
    result = run_retrieval(small_llm, cases, progress=False)
    assert result["num_cases"] == 2 and result["num_refused"] == 0
    assert result["accuracy"] == 1.0, result["cases"]                   # full attention finds it


def test_cli_smoke_with_a_refusing_budget(tmp_path, capsys):
    from kvreplay.cli import main
    out = tmp_path / "quality.json"
    # 7MiB in fp32 holds 9 blocks = 144 tokens: the 96-token case fits (+8 answer tokens), 256 does not
    assert main(["bench", "quality", "--lengths", "96,256", "--depths", "0.5", "--fidelity-prompts", "1",
                 "--fidelity-context", "32", "--fidelity-tokens", "2", "--ppl-tokens", "64",
                 "--budgets", "7MiB", "--dtype", "float32", "--no-progress", "--json", str(out)]) == 0
    assert "| full | 7MiB |" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    assert run["retrieval"]["num_refused"] == 1 and run["retrieval"]["grid"]["256"]["0.5"] == 0.0
    assert run["fidelity"]["top1_agreement"] == 1.0
    assert run["perplexity"]["perplexity"] > 1 and run["perplexity"]["method"] == "full attention"
