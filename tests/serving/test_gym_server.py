"""The NeMo-Gym resources server (``serve protocol=nemo_gym``) on loopback in the project's venv: real uvicorn, the real
KLCF reward on a scripted judge, NeMo-Gym's wire format (its own code calls it in ``test_gym_stack.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytestmark = pytest.mark.waits  # mostly on the server and the judge's HTTP round trips (the waiting lane)

from nemo_factuality.config import REPO_ROOT  # noqa: E402
from nemo_factuality.registry import build_reward  # noqa: E402
from nemo_factuality.serving.config import GymServeConfig, ServeConfig  # noqa: E402
from nemo_factuality.serving.gym_protocol import (  # noqa: E402
    GymRequestError,
    RewardBatcher,
    VerifySample,
    factuality_metrics,
    parse_verify,
)
from nemo_factuality.serving.gym_server import GymRewardServer  # noqa: E402
from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer  # noqa: E402
from nemo_factuality.testing.gym_judge import MODE, POLICY_ANSWERS, QUESTIONS, gym_judge, klcf_config  # noqa: E402
from nemo_factuality.testing.ports import free_ports  # noqa: E402
from nemo_factuality.types import FactualityInputError, RewardBatch  # noqa: E402

NAMES = list(POLICY_ANSWERS)
# By hand from the scripted judge (testing/gym_judge.py): KLCF = checklist recall + truthfulness precision.
# Paris: checklist 1/1, claims [true, false] -> 1 + 1/2; Rome: 0/1, [false] -> 0; Tokyo: 1/2, [true, false] -> 1/2 + 1/2
BY_HAND = {"Paris": 1.5, "Rome": 0.0, "Tokyo": 1.0}


def verify_body(name: str, text: str | None = None, **row) -> dict:
    """What NeMo-Gym's simple agent sends to /verify: the dataset row, plus the policy's Responses-API output."""
    question, checklist = QUESTIONS[name]
    output = [{"id": "msg_0", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": POLICY_ANSWERS[name] if text is None else text,
                            "annotations": []}]}]
    return {"responses_create_params": {"input": [{"role": "system", "content": "Answer in full sentences."},
                                                  {"role": "user", "content": question}]},
            "response": {"id": "resp_0", "object": "response", "output": output}, "checklist": checklist,
            "_ng_task_index": NAMES.index(name), "agent_ref": {"name": "agent"}, **row}


@pytest.fixture(scope="module")
def stack():
    judge = ScriptedOpenAIServer(gym_judge).start()
    reward = build_reward(klcf_config(judge.url))
    (port,) = free_ports(1)
    cfg = ServeConfig(protocol="nemo_gym", host="127.0.0.1", http_port=port, nan_reward=-1.0,
                      gym=GymServeConfig(max_batch_size=16, max_queue_delay_ms=20))
    server = GymRewardServer(cfg, reward).start()
    try:
        yield {"server": server, "reward": reward, "judge": judge, "url": server.url, "cfg": cfg}
    finally:
        server.stop()
        judge.stop()


def post(stack, path: str, body, timeout: float = 30) -> httpx.Response:
    return httpx.post(stack["url"] + path, json=body, timeout=timeout)


def test_verify_gives_each_response_its_methods_reward_and_why(stack):
    """The reward is the one the project's reward API gives in process for the same text (and the hand values);
    the reply is the request plus ``reward`` and ``factuality``: components, each claim and its verdict."""
    replies = {n: post(stack, "/verify", verify_body(n)) for n in NAMES}
    assert {n: r.status_code for n, r in replies.items()} == dict.fromkeys(NAMES, 200)
    inproc = stack["reward"]([QUESTIONS[n][0] for n in NAMES], [POLICY_ANSWERS[n] for n in NAMES],
                             checklist=[QUESTIONS[n][1] for n in NAMES])
    got = {n: r.json() for n, r in replies.items()}
    assert [got[n]["reward"] for n in NAMES] == pytest.approx(list(inproc.scores), abs=1e-12)
    assert {n: got[n]["reward"] for n in NAMES} == pytest.approx(BY_HAND, abs=1e-12)
    paris = got["Paris"]
    assert paris["checklist"] == QUESTIONS["Paris"][1] and paris["agent_ref"] == {"name": "agent"}  # the request, echoed
    assert paris["factuality"]["claims"] == ["Paris is the capital of France.", "Paris has nine airports."]
    assert paris["factuality"]["verdicts"] == ["supported", "not_supported"]
    assert paris["factuality"]["components"]["checklist_recall"] == 1.0
    assert paris["factuality"]["components"]["general_rm"] is None and paris["factuality"]["abstained"] is False


def test_the_prompt_is_the_last_user_turn_and_reasoning_comes_back_as_think():
    body = verify_body("Paris", topic="Paris")
    body["responses_create_params"]["input"].append({"role": "assistant", "content": "Earlier."})
    body["response"]["output"][:0] = [{"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text",
                                                                                          "text": "Recall the capital."}]}]
    sample = parse_verify(body)
    assert sample.prompt == "Tell me about Paris."
    assert sample.completion == "<think>Recall the capital.</think>" + POLICY_ANSWERS["Paris"]
    assert sample.columns == {"checklist": QUESTIONS["Paris"][1], "topic": "Paris"}  # no _ng_* / agent_ref


@pytest.mark.parametrize("mode, phrase", [("down", "HTTP 503"), ("garbage", "no claim could be verified")])
def test_a_judge_that_is_down_or_unreadable_is_a_503_naming_why_never_a_reward(stack, mode, phrase):
    MODE["verify"] = mode
    try:
        failed = post(stack, "/verify", verify_body("Paris"))
    finally:
        MODE["verify"] = None
    assert failed.status_code == 503 and "reward" not in failed.json(), failed.text
    assert failed.json()["detail"].startswith("the reward could not be computed for this response: ") and \
        phrase in failed.json()["detail"]
    assert post(stack, "/verify", verify_body("Paris")).json()["reward"] == BY_HAND["Paris"]  # the judge is back


@pytest.mark.parametrize("body, phrase", [
    ({"responses_create_params": {"input": []}}, "the /verify body has no `response`"),
    (dict(verify_body("Rome"), response={"output": [{"type": "reasoning", "summary": []}]}),
     "response.output has no assistant message to score"),
    (dict(verify_body("Rome"), responses_create_params={"input": 7}), "responses_create_params.input must be"),
    ([1, 2], "/verify: body: Input should be a valid dictionary"),
])
def test_a_bad_request_is_a_one_line_422_and_the_server_keeps_serving(stack, body, phrase):
    bad = post(stack, "/verify", body)
    assert bad.status_code == 422 and phrase in bad.json()["detail"] and "\n" not in bad.json()["detail"], bad.text
    not_json = httpx.post(stack["url"] + "/verify", content=b"{oops", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["detail"].startswith("/verify: the body is not JSON")
    assert post(stack, "/verify", verify_body("Rome")).json()["reward"] == BY_HAND["Rome"]


def test_a_blank_response_abstains_with_nan_reward(stack):
    reply = post(stack, "/verify", verify_body("Rome", text="   ")).json()
    assert reply["reward"] == stack["cfg"].nan_reward == -1.0 and reply["factuality"]["abstained"] is True
    assert reply["factuality"]["score"] is None


def test_64_concurrent_requests_are_batched_and_each_gets_its_own_reward(stack):
    # every third also says a true checklist item (reward 1.5, by hand), the others one false claim (0.0)
    texts = [f"City {i} has {i} parks." + (" Paris is the capital of France." if i % 3 == 0 else "") for i in range(64)]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack["url"], timeout=120) as client:
            return await asyncio.gather(*(client.post("/verify", json=verify_body("Paris", t)) for t in texts))

    batches = stack["server"].metrics.requests.labels("nemo_gym")
    before = batches._value.get()
    replies = asyncio.run(send_all())
    calls = batches._value.get() - before
    assert [r.status_code for r in replies] == [200] * 64
    inproc = stack["reward"](["Tell me about Paris."] * 64, texts, checklist=[QUESTIONS["Paris"][1]] * 64)
    assert [r.json()["reward"] for r in replies] == pytest.approx(list(inproc.scores), abs=1e-12)
    assert [r.json()["reward"] for r in replies] == [1.5 if i % 3 == 0 else 0.0 for i in range(64)]
    assert all(r.json()["response"]["output"][0]["content"][0]["text"] == t for r, t in zip(replies, texts, strict=True))
    assert 64 / 16 <= calls < 64, calls  # batched (at most max_batch_size=16 a call), not one reward call each


def _ground_truth_reward(prompts, completions, **columns):
    """A reward that needs a ``ground_truth`` column (FSPO and KnowRL do) and blocks while ``GATE`` is closed."""
    GATE.wait(30)
    if columns.get("ground_truth") is None:
        raise FactualityInputError("column 'ground_truth' is required (pass ground_truth=[...] with one entry per completion)")
    CALLS.append(len(completions))
    return RewardBatch(np.array([float(c == g) for c, g in zip(completions, columns["ground_truth"], strict=True)]))


GATE, CALLS = threading.Event(), []


def test_at_most_max_pending_requests_are_held_and_a_row_missing_a_column_fails_alone():
    """One request over ``gym.max_pending`` is refused at once (503 busy, bounded memory); a row lacking the column
    the reward needs is never scored in a batch with rows that have it (it would be scored against None)."""
    GATE.clear()
    CALLS.clear()
    batcher = RewardBatcher(_ground_truth_reward, GymServeConfig(max_batch_size=4, max_queue_delay_ms=50, max_pending=3))
    try:
        held = [batcher.submit(VerifySample("q", "a", {"ground_truth": "a"})),
                batcher.submit(VerifySample("q", "b", {"ground_truth": "a"})),
                batcher.submit(VerifySample("q", "a", {}))]
        with pytest.raises(GymRequestError, match=r"busy: 3 requests are waiting or being scored \(gym.max_pending=3\)") as busy:
            batcher.submit(VerifySample("q", "a", {"ground_truth": "a"}))
        assert busy.value.status == 503
        GATE.set()
        assert [f.result(30).scores[0] for f in held[:2]] == [1.0, 0.0]
        with pytest.raises(GymRequestError, match="column 'ground_truth' is required") as missing:
            held[2].result(30)
        assert missing.value.status == 422 and CALLS == [2]  # the two complete rows in one call, the third alone
        assert batcher.submit(VerifySample("q", "a", {"ground_truth": "a"})).result(30).scores[0] == 1.0
    finally:
        GATE.set()
        batcher.close()


def test_aggregate_metrics_are_the_factuality_metrics_over_the_batch(stack):
    replies = [post(stack, "/verify", verify_body(n)).json() for n in NAMES]
    stripped = [{k: v for k, v in r.items() if k not in ("response", "responses_create_params")} for r in replies]
    out = post(stack, "/aggregate_metrics", {"verify_responses": stripped}).json()
    agent = out["agent_metrics"]
    # by hand: rewards 1.5, 0, 1; claims Paris [S, NS], Rome [NS], Tokyo [S, NS]; recall 1, 0, 1/2
    assert agent["n"] == 3 and agent["mean/reward"] == pytest.approx(2.5 / 3)
    assert (agent["claims/total"], agent["claims/supported"], agent["claims/not_supported"]) == (5, 2, 3)
    assert agent["claims/precision"] == pytest.approx(2 / 5) and agent["claims/per_response"] == pytest.approx(5 / 3)
    assert agent["mean/checklist_recall"] == pytest.approx(0.5) and agent["abstain_rate"] == 0.0
    assert "mean/general_rm" not in agent  # no reply had one
    assert out["key_metrics"] == {k: agent[k] for k in ("mean/reward", "abstain_rate", "claims/precision",
                                                        "claims/per_response")}
    assert out["group_level_metrics"] == [{"_ng_task_index": i, "n": 1, "mean/reward": BY_HAND[n]}
                                          for i, n in enumerate(NAMES)]
    assert factuality_metrics([{"reward": 0.5}])["agent_metrics"]["claims/precision"] is None  # another server's reply
    bad = post(stack, "/aggregate_metrics", {"verify_responses": [{"factuality": {}}]})
    assert bad.status_code == 422 and "verify_responses[0] has no numeric `reward`" in bad.json()["detail"]


def test_readiness_names_a_judge_that_is_down_and_metrics_are_exported(stack):
    assert httpx.get(stack["url"] + "/").json() == {"status": "ok"}  # NeMo-Gym's liveness probe
    assert httpx.get(stack["url"] + "/health/ready").json()["ready"] is True
    stack["judge"].models_status = 503
    try:
        down = httpx.get(stack["url"] + "/health/ready")
    finally:
        stack["judge"].models_status = 200
    assert down.status_code == 503 and "HTTP 503" in down.json()["down"]["judge:judge"]
    text = httpx.get(stack["url"] + "/metrics").text
    assert 'factuality_requests_total{model="nemo_gym"}' in text and "factuality_reward_claims_verified" in text


def test_serve_protocol_nemo_gym_serves_from_the_command_line_and_stops_on_sigterm(stack, tmp_path):
    """``nemo-factuality serve --config-name FILE protocol=nemo_gym``: ready, the same reward, a second server on its
    port is one line and exit 2, SIGTERM ends it (exit 0)."""
    config = tmp_path / "klcf_gym.yaml"
    config.write_text(json.dumps({"reward": klcf_config(stack["judge"].url)}))
    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "nemo_factuality.cli", "serve", "--config-name", str(config), "protocol=nemo_gym",
               "host=127.0.0.1", f"http_port={port}"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        reply = httpx.post(f"http://127.0.0.1:{port}/verify", json=verify_body("Tokyo"), timeout=30).json()
        assert reply["reward"] == BY_HAND["Tokyo"]
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and second.stderr.strip() == (
            f"nemo-factuality serve: error: http_port={port}: cannot listen on 127.0.0.1:{port}: Address already in use "
            "(another process is listening on it); stop it or choose another http_port"), second.stderr[-2000:]
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def test_fspos_reply_carries_each_think_sentences_verdict_and_sign_from_text_or_a_reasoning_item(tmp_path):
    """FSPO (the released settings) on a real knowledge store: the reply names each think sentence, its verdict and
    the sign its tokens get; a reasoning item (a vLLM reasoning parser's) scores exactly as the same text inline."""
    from nemo_factuality.serving.gym_protocol import GymRewardService
    from nemo_factuality.testing.methods import build_kb

    reward = build_reward({"name": "fspo", "verifier": {"name": "kb_exact", "store_path": str(build_kb(tmp_path))}})
    service = GymRewardService(reward, ServeConfig(protocol="nemo_gym"))
    steps, answer = "Ada Varga was born in 1917. Ada Varga grew up in Lyon.", "<answer>Ostrava</answer>"
    inline = verify_body("Rome", text=f"{steps}</think>{answer}", ground_truth="Ostrava", knowledge="kb")
    split = verify_body("Rome", text=answer, ground_truth="Ostrava", knowledge="kb")
    split["response"]["output"].insert(0, {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text",
                                                                                           "text": steps}]})
    try:
        replies = [asyncio.run(service.verify(body)) for body in (inline, split)]
    finally:
        service.close()
    for reply in replies:
        why = reply["factuality"]
        assert reply["reward"] == 1.0 and why["components"]["answer"] == 1.0  # answer F1; fact_weight 0 (released)
        assert why["verdicts"] == ["supported", "not_enough_info"] and why["sentence_signs"] == [1, -1]  # not supported: -1
        assert [c.strip() for c in why["claims"]][1] == "Ada Varga grew up in Lyon."
