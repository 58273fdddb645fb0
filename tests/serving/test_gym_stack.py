"""NeMo-Gym's own code (0.4.0, in its stack venv of Python 3.12) against the project's resources servers.

One launch of NeMo-Gym's runner (``ng_run``) from the config the project ships
(``conf/gym/resources_servers/nemo_factuality/configs/nemo_factuality.yaml``): it starts Ray, its head server, the
simple agent, the vLLM model server (on the scripted policy, an OpenAI-compatible server on loopback) and the
project's adapter (``app.py``, the KLCF reward on the scripted judge). Beside it, the project's own server
(``protocol=nemo_gym``, in the project's environment). One driver run in the NeMo-Gym venv (``gym_driver.py``)
then calls the project's server with NeMo-Gym's models and client, collects rollouts with NeMo-Gym's rollout
collection, and makes both fail.
The rewards NeMo-Gym records must equal the project's in-process rewards for the responses it recorded.
"""

from __future__ import annotations

import json
import time

import pytest
from gym_helpers import gym_runner, row, run_driver

from nemo_factuality.registry import build_reward
from nemo_factuality.serving.config import ServeConfig
from nemo_factuality.serving.gym_server import GymRewardServer
from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer
from nemo_factuality.testing.gym_judge import (
    OUTAGE,
    OUTAGE_QUESTION,
    POLICY_ANSWERS,
    POLICY_REPLIES,
    QUESTIONS,
    gym_judge,
    klcf_config,
)
from nemo_factuality.testing.ports import free_ports

NAMES = list(POLICY_ANSWERS)
BY_HAND = {"Paris": 1.5, "Rome": 0.0, "Tokyo": 1.0}  # test_gym_server.py says why


@pytest.fixture(scope="module")
def gym_run(gym_venv, tmp_path_factory):
    work = tmp_path_factory.mktemp("gym_run")
    judge = ScriptedOpenAIServer(gym_judge).start()
    policy = ScriptedOpenAIServer(by_substring=POLICY_REPLIES, default="I do not know.", model="policy").start()
    reward_block = klcf_config(judge.url)
    serve_yaml = work / "klcf_gym.yaml"
    serve_yaml.write_text(json.dumps({"reward": reward_block}))
    head, agent, model, adapter, project = free_ports(5)
    server = GymRewardServer(ServeConfig(protocol="nemo_gym", host="127.0.0.1", http_port=project),
                             build_reward(reward_block)).start()
    try:
        ports = {"head": head, "agent": agent, "model": model, "adapter": adapter}
        with gym_runner(gym_venv, work, ports, policy.url, serve_yaml) as ready_s:
            rows = [row(QUESTIONS[n][0], QUESTIONS[n][1], POLICY_ANSWERS[n]) for n in NAMES]
            (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            outage_row = row(OUTAGE_QUESTION, ["Atlantis sank."], POLICY_REPLIES["Atlantis"])
            start = time.monotonic()
            out = run_driver(gym_venv, work, f"--project-url={server.url}", f"--head-port={head}",
                             f"--rows={work / 'rows.jsonl'}", f"--outage-row={json.dumps(outage_row)}")
            yield {"work": work, "out": out, "judge": judge, "reward": build_reward(reward_block), "ready_s": ready_s,
                   "driver_s": time.monotonic() - start}
    finally:
        server.stop()
        policy.stop()
        judge.stop()


def rollouts(gym_run) -> list[dict]:
    return [json.loads(line) for line in (gym_run["work"] / "out" / "rollouts.jsonl").read_text().splitlines()]


def test_nemo_gyms_client_and_models_take_the_project_servers_replies(gym_run):
    """NeMo-Gym's SimpleAgentVerifyResponse / AggregateMetrics validated what the project's server answered; the
    rewards are the in-process ones (and the hand values)."""
    replies = gym_run["out"]["project"]["replies"]
    inproc = gym_run["reward"]([QUESTIONS[n][0] for n in NAMES], [POLICY_ANSWERS[n] for n in NAMES],
                               checklist=[QUESTIONS[n][1] for n in NAMES])
    assert [r["reward"] for r in replies] == pytest.approx(list(inproc.scores), abs=1e-12)
    assert [r["reward"] for r in replies] == [BY_HAND[n] for n in NAMES]
    assert replies[0]["factuality"]["verdicts"] == ["supported", "not_supported"]
    agent = gym_run["out"]["project"]["aggregate"]["agent_metrics"]
    assert agent["mean/reward"] == pytest.approx(2.5 / 3) and agent["claims/precision"] == pytest.approx(2 / 5)


def test_rollout_collection_records_the_projects_in_process_rewards_for_its_responses(gym_run):
    """NeMo-Gym's runner started the adapter from the shipped config; its rollout collection asked the policy (the
    vLLM model server on the scripted OpenAI server) and the adapter: every reward it recorded is what the project's
    reward gives in process for the response it recorded."""
    got = sorted(rollouts(gym_run), key=lambda r: r["_ng_task_index"])
    assert len(got) == len(NAMES) and gym_run["out"]["collect"]["results"] == len(NAMES)
    texts = ["".join(part["text"] for item in r["response"]["output"] if item["type"] == "message"
                     for part in item["content"]) for r in got]
    assert texts == [POLICY_ANSWERS[n] for n in NAMES]  # the policy's answers went through NeMo-Gym's model server
    inproc = gym_run["reward"]([QUESTIONS[n][0] for n in NAMES], texts, checklist=[r["checklist"] for r in got])
    assert [r["reward"] for r in got] == pytest.approx(list(inproc.scores), abs=1e-12)
    assert [r["reward"] for r in got] == [BY_HAND[n] for n in NAMES]
    assert [r["factuality"]["claims"] for r in got][2] == ["Tokyo is the capital of Japan.", "Tokyo is in Japan."]
    assert (gym_run["work"] / "out" / "rollouts_failures.jsonl").read_text() == ""
    (entry,) = json.loads((gym_run["work"] / "out" / "rollouts_aggregate_metrics.json").read_text())
    assert entry["key_metrics"] == pytest.approx({"mean/reward": 2.5 / 3, "abstain_rate": 0.0, "claims/precision": 0.4,
                                                  "claims/per_response": 5 / 3})
    assert entry["agent_metrics"]["max/reward"] == 1.5  # NeMo-Gym's own statistics, beside the factuality ones


def test_a_failed_judge_fails_the_verify_and_its_rollout_never_a_reward(gym_run):
    """The project's server and the adapter answer a judge outage with 503 and its reason (NeMo-Gym's client raises:
    NeMo-RL retries a 5xx as an infrastructure failure); through the agent the rollout fails (500); a bad request
    is a 422."""
    project = gym_run["out"]["project"]["outage"]
    runner = gym_run["out"]["runner"]
    for failed in (project, runner["adapter_outage"]):
        assert failed["status"] == 503 and "the reward could not be computed for this response" in failed["content"]
        assert "HTTP 503" in failed["content"] and "reward\"" not in failed["content"]
    assert runner["agent_outage"]["status"] == 500 and "could not be computed" in runner["agent_outage"]["content"]
    assert runner["adapter_bad_request"]["status"] == 422
    assert OUTAGE in POLICY_REPLIES["Atlantis"]
