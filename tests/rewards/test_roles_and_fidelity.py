"""Issue 11 §3 (one judge per role, a general RM that takes effect) and §4 (fidelity to methods.md)."""

import json
import math

import numpy as np
import pytest
import torch

from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.knowledge.store import build_store
from nemo_factuality.pipeline import build_pipeline
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards import FactualityEnvironment
from nemo_factuality.rewards.factalign import FactAlignConfig, FactAlignLabeler
from nemo_factuality.rewards.knowrl import KnowRLReward
from nemo_factuality.rewards.rlfh import RLFHReward
from nemo_factuality.serving.config import ServeConfig
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.testing.tiny_models import build_tiny_sequence_classifier
from nemo_factuality.types import FactualityInputError
from nemo_factuality.verify.llm_judge import AnswerGrader, InformativenessScorer

pytestmark = pytest.mark.waits  # mostly on scripted judges' timeouts (tests/conftest.py gives it the waiting lane)

TRUE = "Ada Varga was born in 1917."


# ------------------------------------------------------------------------------------------- §3 roles
def _role_server(reply):
    return ScriptedOpenAIServer(lambda req: Reply(reply(req["messages"][-1]["content"])))


def test_klcf_sends_each_role_to_its_own_model(tmp_path):
    extractor = _role_server(lambda c: f"- {TRUE}")
    checklist = _role_server(lambda c: "Covered")
    truth = _role_server(lambda c: "True")
    with extractor, checklist, truth:
        spec = {"name": "klcf", "w_rm": 0.0,
                "judge": {"base_url": extractor.url, "model": "KLCF-Qwen2.5-14B-Claim-Extractor", "max_retries": 0},
                "checklist_judge": {"base_url": checklist.url, "model": "KLCF-Qwen2.5-14B-Checklist-Verifier"},
                "pipeline": {"extractor": {"name": "klcf"}, "evidence": {"name": "none"},
                             "verifier": {"name": "llm_judge", "style": "truthfulness",
                                          "judge": {"base_url": truth.url, "model": "KLCF-Qwen2.5-14B-Truthfulness-Verifier"}}}}
        out = REWARDS.build(spec)(["Who is Ada?"], [TRUE], checklist=[["Ada Varga was born in 1917."]])
        seen = {name: [(r["model"], r["messages"][-1]["content"]) for r in srv.requests]
                for name, srv in (("extractor", extractor), ("checklist", checklist), ("truth", truth))}
    assert out.scores[0] == pytest.approx(2.0) and "error" not in out.details[0]
    assert [m for m, _ in seen["extractor"]] == ["KLCF-Qwen2.5-14B-Claim-Extractor"]
    assert all("Extract every verifiable" in c for _, c in seen["extractor"])
    assert [m for m, _ in seen["checklist"]] == ["KLCF-Qwen2.5-14B-Checklist-Verifier"]
    assert [m for m, _ in seen["truth"]] == ["KLCF-Qwen2.5-14B-Truthfulness-Verifier"]
    assert all("Is the following claim true?" in c for _, c in seen["truth"])
    # the role block inherits the shared keys it does not set (max_retries from `judge`)
    pipe = REWARDS.build(spec).pipeline
    assert pipe.verifier.client.max_retries == 0 and pipe.verifier.client.model.endswith("Truthfulness-Verifier")


def test_shipped_klcf_config_names_seed_000_models():
    cfg = load_config(ServeConfig, str(REPO_ROOT / "conf" / "serve" / "klcf.yaml"))
    r = cfg.reward
    assert r["pipeline"]["extractor"]["judge"]["model"] == "KLCF-Qwen2.5-14B-Claim-Extractor"
    assert r["checklist_judge"]["model"] == "KLCF-Qwen2.5-14B-Checklist-Verifier"
    assert r["pipeline"]["verifier"]["judge"]["model"] == "KLCF-Qwen2.5-14B-Truthfulness-Verifier"
    assert r["w_rm"] > 0 and r["general_rm"]["kind"] in ("hf", "remote")


def test_rlfh_and_knowrl_role_judges(kb):
    main = _role_server(lambda c: "B")
    grader = _role_server(lambda c: "A")
    with main, grader:
        reward = REWARDS.build({"name": "knowrl", "judge": {"base_url": main.url, "model": "shared"},
                                "grader_judge": {"model": "grader", "base_url": grader.url},
                                "pipeline": {"verifier": {"name": "kb_exact", "store_path": kb}}})
        out = reward(["When?"], [f"{TRUE}</think><answer>1917</answer>"], ground_truth=["1917"])
        assert out.components["correct"][0] == 2.0 and [r["model"] for r in grader.requests] == ["grader"]
        rlfh = REWARDS.build({"name": "rlfh", "judge": {"base_url": main.url, "model": "shared"},
                              "info_judge": {"model": "info", "base_url": grader.url},
                              "pipeline": {"extractor": {"name": "rlfh"}, "verifier": {"name": "llm_judge", "style": "rlfh"}}})
        assert rlfh.info_scorer.client.model == "info" and rlfh.pipeline.extractor.client.model == "shared"


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_rm")
    model, tok = build_tiny_sequence_classifier(d, family="llama", num_labels=1, seed=3)
    return d, model, tok


def test_general_rm_from_config_takes_effect(tiny_rm, kb):
    path, model, tok = tiny_rm
    prompts, completions = ["Who is Ada?", "Tell me about Ada Varga please."], [TRUE, "Ada Varga grew up in Ostrava."]
    spec = {"name": "klcf", "w_checklist": 0.0, "w_truthfulness": 1.0, "w_rm": 2.0, "rm_temperature": 1.5,
            "general_rm": {"kind": "hf", "model_path": str(path), "batch_size": 1},
            "pipeline": {"verifier": {"name": "kb_exact", "store_path": kb}, "abstain_detection": None}}
    out = REWARDS.build(spec)(prompts, completions)
    # independent reference: HF forward of each rendered chat, one at a time (no padding)
    expected = []
    for p, c in zip(prompts, completions, strict=True):
        text = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
        with torch.no_grad():
            logit = model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        expected.append(1 / (1 + math.exp(-logit / 1.5)))
    np.testing.assert_allclose(out.components["general_rm"], expected, atol=1e-5)
    np.testing.assert_allclose(out.scores, out.components["truthfulness_precision"] + 2.0 * np.array(expected), atol=1e-5)
    with pytest.raises(FactualityInputError, match="w_rm > 0 needs a general reward model"):
        REWARDS.build({k: v for k, v in spec.items() if k != "general_rm"})
    # batched (padded) scoring gives the same numbers as one at a time
    batched = REWARDS.build({**spec, "general_rm": {"kind": "hf", "model_path": str(path), "batch_size": 8}})(prompts, completions)
    np.testing.assert_allclose(batched.components["general_rm"], expected, atol=1e-5)


def test_general_rm_served_reward_is_the_models_raw_score(tiny_rm):
    """``nemo-factuality serve --config-name general_rm`` builds this reward: the score is the RM's raw logit (KLCF
    applies σ itself), from the serve config as shipped plus the model path."""
    path, model, tok = tiny_rm
    cfg = load_config(ServeConfig, "general_rm", [f"reward.model_path={path}", "reward.batch_size=1"], group="serve")
    reward = REWARDS.build(cfg.reward)
    prompts, completions = ["Who is Ada?", "Where was she born?"], [TRUE, "In Ostrava, I believe."]
    out = reward(prompts, completions)
    expected = []
    for p, c in zip(prompts, completions, strict=True):
        text = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
        with torch.no_grad():
            expected.append(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item())
    np.testing.assert_allclose(out.scores, expected, atol=1e-5)
    np.testing.assert_allclose(out.components["general_rm"], expected, atol=1e-5)
    assert reward.health() == {f"general_rm:{path}": None}
    with pytest.raises(FactualityInputError, match="general_rm: 2 prompts but 1 completions"):
        reward(prompts, completions[:1])


def test_remote_general_rm_on_our_server_fails_loudly():
    """``model_name: factuality_reward`` (our server's rich model, NaN kept): a dead server is an error naming the key."""
    from nemo_factuality.rewards.general_rm import GeneralRMError, build_general_rm

    rm = build_general_rm({"kind": "remote", "url": "http://127.0.0.1:9", "model_name": "factuality_reward", "timeout_s": 1})
    with pytest.raises(GeneralRMError, match=r"general RM: reward server http://127\.0\.0\.1:9 .*reward\.general_rm\.url"):
        rm(["q"], ["a"])


# ------------------------------------------------------------------------------------------- §4 RLFH
RESPONSE = "Paris is the capital of France and has two airports."


def _rlfh_judge(echo):
    def script(req):
        content = req["messages"][-1]["content"]
        if "atomic statements" in content:
            return Reply(f">> Sentence 1: {echo}\n* The capital of France is Paris\n* Paris has two airports")
        return Reply("Correct") if "Choose from" in content else Reply("4")
    return script


def test_rlfh_informativeness_survives_a_changed_comma_in_the_echo(tiny_tokenizer):
    echo = "Paris is the capital of France, and has two airports"  # one comma added, final period dropped
    with ScriptedOpenAIServer(_rlfh_judge(echo)) as srv:
        client = OpenAIJudgeClient(srv.url, "judge")
        pipe = build_pipeline({"extractor": {"name": "rlfh"}, "evidence": {"name": "bm25_sections"},
                               "verifier": {"name": "llm_judge", "style": "rlfh"}}, judge_client=client)
        out = RLFHReward(pipe, InformativenessScorer(client), tokenizer=tiny_tokenizer)(["q"], [RESPONSE], materials=[["x"]])
        plain = RLFHReward(pipe, InformativenessScorer(client))(["q"], [RESPONSE], materials=[["x"]])
    assert out.components["info"][0] == pytest.approx(1.2 * math.log(3))  # not 0: the sentence still gets r_info
    assert out.scores[0] == pytest.approx(float(out.token_rewards[0].sum(dtype=np.float64)), abs=1e-9)
    assert plain.scores[0] == pytest.approx(out.scores[0], abs=1e-5)  # same scalar with or without a tokenizer


def test_rlfh_scalar_is_the_sum_of_clipped_tokens(tiny_tokenizer):
    def judge(req):  # one verbatim statement (ends at "France"), one paraphrase (ends at "airports")
        content = req["messages"][-1]["content"]
        if "atomic statements" in content:
            return Reply(f">> Sentence 1: {RESPONSE}\n* Paris is the capital of France\n* Paris has two airports")
        return Reply("Correct") if "Choose from" in content else Reply("4")

    with ScriptedOpenAIServer(judge) as srv:
        client = OpenAIJudgeClient(srv.url, "judge")
        pipe = build_pipeline({"extractor": {"name": "rlfh"}, "evidence": {"name": "bm25_sections"},
                               "verifier": {"name": "llm_judge", "style": "rlfh"}}, judge_client=client)
        from nemo_factuality.rewards.rlfh import RLFHConfig

        cfg = RLFHConfig(reward_clip=(-10.0, 0.5))
        tok = RLFHReward(pipe, InformativenessScorer(client), cfg, tiny_tokenizer)(["q"], [RESPONSE], materials=[["x"]])
        plain = RLFHReward(pipe, InformativenessScorer(client), cfg)(["q"], [RESPONSE], materials=[["x"]])
    assert tok.scores[0] == pytest.approx(float(tok.token_rewards[0].sum(dtype=np.float64)), abs=1e-9)
    # 0.45 + 0.45 + min(0.5, 1.2 ln 3): per-position clipping, with or without a tokenizer (not clip(total))
    assert tok.scores[0] == pytest.approx(1.4, abs=1e-5) and plain.scores[0] == pytest.approx(1.4, abs=1e-5)


# ------------------------------------------------------------------------------------------- §4 FSPO
@pytest.mark.parametrize("bias, supported", [(-8.0, False), (8.0, True)])
def test_fspo_single_logit_hhem_head_uses_sigmoid(tmp_path, bias, supported):
    build_tiny_sequence_classifier(tmp_path, family="bert", num_labels=1, head_bias=bias)
    reward = REWARDS.build({"name": "fspo", "fact_weight": 1.0,
                            "verifier": {"name": "nli", "model_path": str(tmp_path), "threshold": 0.5,
                                         "prompt_template": "<pad> Premise: {premise}\n\nHypothesis: {hypothesis}",
                                         "trust_remote_code": False}})
    out = reward(["q"], ["Ada Varga was born in 1917.</think><answer>1917</answer>"], ground_truth=["1917"],
                 knowledge=["Ada Varga was born in 1917."])
    assert out.components["reasoning"][0] == (1.0 if supported else -1.0)


def test_nli_prompt_template_is_what_the_model_reads(tmp_path):
    from nemo_factuality.interfaces import VerifyItem
    from nemo_factuality.types import Claim
    from nemo_factuality.verify.nli import NLIVerifier

    model, tok = build_tiny_sequence_classifier(tmp_path, family="bert", num_labels=1, seed=5)
    tpl = "Determine if the hypothesis is true given the premise?\n\nPremise: {premise}\n\nHypothesis: {hypothesis}"
    (v,) = NLIVerifier(str(tmp_path), prompt_template=tpl).verify_batch([VerifyItem(Claim(0, "B."), evidence=("A.",))])
    with torch.no_grad():
        logit = model(**tok(tpl.format(premise="A.", hypothesis="B."), return_tensors="pt")).logits[0, 0].item()
    assert v.score == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-6)
    with pytest.raises(FactualityInputError, match="prompt_template"):
        NLIVerifier(str(tmp_path), prompt_template="no fields")


# ------------------------------------------------------------------------------------------- §4 KnowRL
def test_knowrl_semicolon_topics_search_every_title(tmp_path):
    passages = [{"title": "Ada Varga", "text": "Ada Varga was a painter."},
                {"title": "Lev Novak", "text": "Lev Novak was born in 1950."}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    kb = str(build_store(tmp_path / "p.jsonl", tmp_path / "kb.sqlite", progress=False))

    def judge(req):
        content = req["messages"][-1]["content"]
        if "Predicted answer" in content:
            return Reply("A")
        claim = content.split("Input:")[-1].split("True or False?")[0].strip()
        return Reply("True" if claim in content.split("Input:")[0] else "False")

    with ScriptedOpenAIServer(judge) as srv:
        client = OpenAIJudgeClient(srv.url, "judge")
        pipe = build_pipeline({"extractor": {"name": "identity"}, "evidence": {"name": "kb", "store_path": kb, "k": 2},
                               "verifier": {"name": "llm_judge", "style": "factscore"}, "abstain_detection": None},
                              judge_client=client)
        reward = KnowRLReward(pipe, AnswerGrader(client))
        out = reward(["Who?"], ["Lev Novak was born in 1950.</think><answer>1950</answer>"], ground_truth=["1950"],
                     topic=["Ada Varga; Lev Novak"])
    assert out.components["fact"][0] > 0  # the second title's passage was found and supports the fact


# ------------------------------------------------------------------------------------------- §4 FactAlign
def test_factalign_notebook_precision_switch(kb_pipeline):
    resp = "Ada Varga was born in 1917. Lev Novak was born in unknown."  # S=1, IR=1 (an abstaining claim)
    safe = FactAlignLabeler(kb_pipeline, FactAlignConfig(k=1))(["q"], [resp])
    notebook = FactAlignLabeler(kb_pipeline, FactAlignConfig(k=1, precision="notebook"))(["q"], [resp])
    assert safe.components["precision"][0] == 1.0 and safe.scores[0] == 1.0
    assert notebook.components["precision"][0] == 0.5 and notebook.scores[0] == pytest.approx(2 * 0.5 / 1.5)
    with pytest.raises(FactualityInputError, match="factalign.precision"):
        FactAlignConfig(precision="paper")


def test_factalign_repeated_sentence_is_negative_with_dedup(kb_pipeline):
    resp = f"{TRUE} Ada Varga grew up in Ostrava. {TRUE}"
    out = FactAlignLabeler(kb_pipeline, FactAlignConfig(k=2, rep_ngram=50))(["q"], [resp])
    assert out.sentence_labels[0] == [True, True, False]
    assert [s.slice(resp) for s in out.sentence_spans[0]][-1] == TRUE


# ------------------------------------------------------------------------------------------- §4 NeMo-RL adapter
def test_nemo_rl_metadata_of_the_wrong_length_raises(kb_pipeline):
    env = FactualityEnvironment(FactAlignLabeler(kb_pipeline, FactAlignConfig(k=1)))
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": TRUE}]] * 2
    with pytest.raises(FactualityInputError, match="1 metadata entries for 2 message logs"):
        env.step(logs, [{"topic": "Ada Varga"}])
    assert env.step(logs, [None, None]).rewards.tolist() == [1.0, 1.0]


def test_a_misspelt_role_judge_key_is_named():
    with pytest.raises(FactualityInputError, match=r"judge config: unknown key\(s\) \['modle'\]"):
        build_pipeline({"extractor": {"name": "klcf", "judge": {"modle": "x"}}},
                       judge_defaults={"base_url": "http://127.0.0.1:1/v1", "model": "m"})
