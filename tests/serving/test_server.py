"""The real PyTriton server in-process on loopback, called with NeMo-Aligner's exact payload."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("pytriton")
pytestmark = pytest.mark.waits  # mostly on the reward server and judges (tests/conftest.py gives it the waiting lane)

from nemo_factuality.judge.client import OpenAIJudgeClient  # noqa: E402
from nemo_factuality.pipeline import build_pipeline  # noqa: E402
from nemo_factuality.rewards.rlfh import RLFHReward  # noqa: E402
from nemo_factuality.serving.client import RemoteFactualityReward, RemoteRewardError  # noqa: E402
from nemo_factuality.serving.config import ServeConfig  # noqa: E402
from nemo_factuality.serving.server import TRITON_LOG, FactualityRewardServer  # noqa: E402
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer  # noqa: E402
from nemo_factuality.testing.ports import free_ports  # noqa: E402
from nemo_factuality.verify.llm_judge import InformativenessScorer  # noqa: E402

PROMPTS = ["Tell me about Paris.", "Tell me about Rome.", "Who are you?"]
RESPONSES = ["Paris is the capital of France. It has two airports.", "Rome is in Italy.", "I'm sorry, I can't say."]
MODE = {"verify": "Correct", "alive_for": None, "dead_on": ()}
_CALLS = {"n": 0}
_CALLS_LOCK = threading.Lock()


def _judge(req):
    content = req["messages"][-1]["content"]
    if MODE["alive_for"] is not None:  # the judge dies mid-batch: after N answers every request gets 503
        with _CALLS_LOCK:
            _CALLS["n"] += 1
            dead = _CALLS["n"] > MODE["alive_for"]
        if dead:
            return Reply("judge process died", status=503)
    if any(key in content for key in MODE["dead_on"]):  # ... or dies for the second half of the batch
        return Reply("judge process died", status=503)
    if "atomic statements" in content:
        resp = content.split("Response:")[-1].strip()
        lines = []
        for k, sent in enumerate(s.strip() + "." for s in resp.split(".") if s.strip()):
            lines += [f">> Sentence {k + 1}: {sent}", f"* {sent}"]
        return Reply("\n".join(lines) or "No statements")
    if "Choose from" in content:
        if MODE["verify"] == "slow":
            return Reply("Correct", delay_s=1.5)
        if MODE["verify"] == "down":
            return Reply("upstream unavailable", status=503)
        return Reply("Wrong" if "Rome" in content.split("Statement:")[-1] else MODE["verify"])
    return Reply("3")


class _TritonRecords(logging.Handler):
    """Every record of the tritonserver logger, DEBUG included, while in its ``with`` block."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._level = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _TritonRecords:
        self._level = TRITON_LOG.level
        TRITON_LOG.setLevel(logging.DEBUG)
        TRITON_LOG.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        TRITON_LOG.removeHandler(self)
        TRITON_LOG.setLevel(self._level)


@pytest.fixture(scope="module")
def stack(tiny_tokenizer_dir, tiny_tokenizer):
    os.environ.setdefault("PYTRITON_HOME", tempfile.mkdtemp(prefix="pytriton_home_"))
    judge = ScriptedOpenAIServer(_judge).start()
    client = OpenAIJudgeClient(judge.url, "judge", timeout_s=5, max_retries=0)
    pipe = build_pipeline({"extractor": {"name": "rlfh"}, "verifier": {"name": "llm_judge", "style": "rlfh"},
                           "abstain_detection": None}, judge_client=client)
    reward = RLFHReward(pipe, InformativenessScorer(client), tokenizer=tiny_tokenizer)
    http, grpc, tmetrics, health, metrics = free_ports(5)
    cfg = ServeConfig(policy_tokenizer=str(tiny_tokenizer_dir), host="127.0.0.1", http_port=http, grpc_port=grpc,
                      triton_metrics_port=tmetrics, health_port=health, metrics_port=metrics, max_queue_delay_us=500)
    server = FactualityRewardServer(cfg, reward)
    start_up = _TritonRecords()  # what tritonserver logs while it starts (test_a_good_start_logs_no_error)
    try:
        with start_up:
            server.start()
        yield {"server": server, "reward": reward, "cfg": cfg, "judge": judge, "url": f"http://127.0.0.1:{http}",
               "start_up": start_up.records}
    finally:
        server.stop()
        judge.stop()
        client.close()


def aligner_payload(tokenizer, prompts, responses, pad_to_length=128):
    """Exactly what NeMo-Aligner's RemoteGPTRMClient sends: policy ids padded with 0, lengths [B, 1]."""
    rows = []
    for p, r in zip(prompts, responses):
        prefix = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        resp = tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((ids + resp, len(ids), resp))
    tokens = np.zeros((len(rows), pad_to_length), dtype=np.int64)
    for i, (ids, _, _) in enumerate(rows):
        tokens[i, : len(ids)] = ids
    lengths = np.array([[len(ids)] for ids, _, _ in rows], dtype=np.int64)
    return tokens, lengths, rows


def _infer(url, model, timeout=60, **inputs):
    from pytriton.client import ModelClient

    with ModelClient(url, model, init_timeout_s=30, inference_timeout_s=timeout) as c:
        return c.infer_batch(**inputs)


def test_reward_model_matches_in_process_on_aligner_payload(stack, tiny_tokenizer):
    tokens, lengths, rows = aligner_payload(tiny_tokenizer, PROMPTS, RESPONSES)
    out = _infer(stack["url"], "reward_model", tokens=tokens, sequence_lengths=lengths)
    assert out["rewards"].shape == (3, 1) and out["rewards"].dtype == np.float32
    expected = stack["reward"](PROMPTS, RESPONSES, completion_ids=[r for _, _, r in rows], is_end=[True] * 3).scores
    np.testing.assert_allclose(out["rewards"][:, 0], np.nan_to_num(expected, nan=0.0).astype(np.float32), rtol=0, atol=1e-6)
    assert out["rewards"][0, 0] > 0 > out["rewards"][1, 0]  # Rome's statement is judged Wrong


def test_one_request_larger_than_256_samples(stack, tiny_tokenizer):
    """Aligner sends a whole rollout batch in one request; its own server accepts any size, so does ours."""
    assert ServeConfig().max_batch_size >= 4096
    n = 257  # one more than the old limit (256)
    tokens, lengths, rows = aligner_payload(tiny_tokenizer, [PROMPTS[2]] * (n - 1) + [PROMPTS[0]],
                                            [RESPONSES[2]] * (n - 1) + [RESPONSES[0]], pad_to_length=64)
    out = _infer(stack["url"], "reward_model", timeout=120, tokens=tokens, sequence_lengths=lengths)
    assert out["rewards"].shape == (n, 1)
    expected = stack["reward"]([PROMPTS[2], PROMPTS[0]], [RESPONSES[2], RESPONSES[0]], completion_ids=[rows[0][2], rows[-1][2]], is_end=[True] * 2).scores
    np.testing.assert_allclose(out["rewards"][[0, -1], 0], np.nan_to_num(expected, nan=0.0).astype(np.float32), atol=1e-6)
    assert len(set(out["rewards"][:-1, 0].tolist())) == 1  # the same sample gets the same reward in every row


def test_sentences_input(stack, tiny_tokenizer):
    texts = [tiny_tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) + r
             for p, r in zip(PROMPTS[:2], RESPONSES[:2])]
    out = _infer(stack["url"], "reward_model", sentences=np.array([[t.encode()] for t in texts], dtype=object))
    expected = stack["reward"](PROMPTS[:2], RESPONSES[:2]).scores
    np.testing.assert_allclose(out["rewards"][:, 0], expected.astype(np.float32), atol=1e-5)


def test_rich_model_token_rewards_aligned_to_policy_tokens(stack, tiny_tokenizer):
    tokens, lengths, rows = aligner_payload(tiny_tokenizer, PROMPTS[:2], RESPONSES[:2], pad_to_length=96)
    out = _infer(stack["url"], "factuality_reward", tokens=tokens, sequence_lengths=lengths)
    assert out["token_rewards"].shape == (2, 96) and out["token_signs"].dtype == np.int8
    inproc = stack["reward"](PROMPTS[:2], RESPONSES[:2], completion_ids=[r for _, _, r in rows], is_end=[True, True])
    for i, (ids, prompt_len, resp) in enumerate(rows):
        np.testing.assert_allclose(out["token_rewards"][i, prompt_len : prompt_len + len(resp)], inproc.token_rewards[i], atol=1e-6)
        assert not out["token_rewards"][i, :prompt_len].any() and not out["token_rewards"][i, len(ids):].any()
        details = json.loads(out["details"][i, 0])
        assert details["n_response_tokens"] == len(resp) and details["response_offset"] == prompt_len


def test_remote_client_equals_in_process(stack):
    remote = RemoteFactualityReward(stack["url"])
    got = remote(PROMPTS, RESPONSES)
    ref = stack["reward"](PROMPTS, RESPONSES)
    np.testing.assert_allclose(got.scores, ref.scores, atol=1e-5)
    for a, b in zip(got.token_rewards, ref.token_rewards):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert set(got.components) == set(ref.components)


@pytest.mark.parametrize("bad,needle", [
    ({"tokens": np.zeros((1, 8), dtype=np.int64), "sequence_lengths": np.array([[9]], dtype=np.int64)}, "sequence_lengths=9"),
    ({"tokens": np.ones((1, 8), dtype=np.int64), "sequence_lengths": np.array([[8]], dtype=np.int64)}, "response marker"),
    ({"sentences": np.array([[b"\xff\xfe"]], dtype=object)}, "invalid UTF-8"),
    ({"sequence_lengths": np.array([[3]], dtype=np.int64)}, "send 'tokens'"),
])
def test_malformed_inputs_get_clear_errors_and_server_keeps_serving(stack, tiny_tokenizer, bad, needle):
    from pytriton.client.exceptions import PyTritonClientInferenceServerError

    with pytest.raises(PyTritonClientInferenceServerError, match=needle):
        _infer(stack["url"], "reward_model", **bad)
    tokens, lengths, _ = aligner_payload(tiny_tokenizer, PROMPTS[:1], RESPONSES[:1])
    assert _infer(stack["url"], "reward_model", tokens=tokens, sequence_lengths=lengths)["rewards"].shape == (1, 1)


def test_tritons_output_goes_to_logging_not_the_terminal(stack, capfd, caplog):
    """PyTriton printed every tritonserver line to stdout from a thread: a failed batch's Python-backend traceback
    (``…/proxy/model.py(501): execute``) landed among pytest's dots. Now it is logged, at its own level."""
    import logging

    from pytriton.client.exceptions import PyTritonClientInferenceServerError

    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="nemo_factuality.serving.tritonserver"):
        with pytest.raises(PyTritonClientInferenceServerError):
            _infer(stack["url"], "reward_model", sequence_lengths=np.array([[3]], dtype=np.int64))  # no tokens
        deadline = time.monotonic() + 15
        while not any("model.py(" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.1)
    traceback_lines = [r for r in caplog.records if "model.py(" in r.getMessage()]
    assert traceback_lines and all(r.levelno == logging.ERROR for r in traceback_lines), caplog.text[-2000:]
    printed = capfd.readouterr()
    assert "model.py(" not in printed.out + printed.err and "Model execute error" not in printed.out + printed.err


def test_a_good_start_logs_no_error(stack):
    """A successful start on a machine without a GPU printed tritonserver's "CudaDriverHelper has not been initialized"
    and "Failed to set config modification time" as ERROR lines (18 in a good lab run): they are logged at DEBUG now,
    and nothing else tritonserver says while starting is an error."""
    records = stack["start_up"]
    assert records, "tritonserver's start-up output did not reach the logger"
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    benign = [r for r in records if any(k in r.getMessage() for k in ("CudaDriverHelper", "config modification time",
                                                                      "pinned memory pool"))]
    assert benign and {r.levelno for r in benign} == {logging.DEBUG}  # they were printed, and demoted


def test_wrong_dtype_is_refused(stack):
    from pytriton.client.exceptions import PyTritonClientError

    with pytest.raises(PyTritonClientError):
        _infer(stack["url"], "reward_model", tokens=np.zeros((1, 4), dtype=np.int32), sequence_lengths=np.array([[4]], dtype=np.int64))


def test_garbage_and_slow_judge_mid_batch(stack, tiny_tokenizer):
    remote = RemoteFactualityReward(stack["url"])
    try:
        MODE["verify"] = "I refuse to answer"
        garbage = remote(PROMPTS[:1], RESPONSES[:1])
        assert stack["reward"].stats()["unparseable"] >= 1  # counted, not silently defaulted
        MODE["verify"] = "down"  # the verifying judge is down: NaN + reason per sample, server keeps serving
        before = stack["reward"].stats().get("judge_errors", 0.0)
        down = remote(PROMPTS[:2], RESPONSES[:2])
        assert np.isnan(down.scores).all() and stack["reward"].stats()["judge_errors"] >= before + 2
        assert all("verification failed" in d["error"] and "HTTP 503" in d["error"] for d in down.details)
        MODE["verify"] = "slow"  # judge slower than the client's 5 s... per call timeout is 5 s; 1.5 s delay is fine
        slow = remote(PROMPTS[:1], RESPONSES[:1])
        assert np.isfinite(slow.scores).all()
        # a client that gives up (disconnects) does not take the server down
        with pytest.raises(RemoteRewardError, match=r"reward.timeout_s"):
            RemoteFactualityReward(stack["url"], timeout_s=0.2)(PROMPTS[:1], RESPONSES[:1])
    finally:
        MODE["verify"] = "Correct"
    # every verdict unreadable: nothing was verified, so no score (never a 0.0 that looks real)
    assert np.isnan(garbage.scores).all() and "no claim could be verified" in garbage.details[0]["error"]
    time.sleep(1.5)  # let the abandoned batch finish
    assert remote(PROMPTS[:1], RESPONSES[:1]).scores[0] > 0


def test_judge_dies_mid_batch_per_sample_errors_reach_every_client(stack, tiny_tokenizer):
    """The judge answers a few requests, then dies: the samples it finished keep real rewards, the others are
    NaN with the judge's error on ``factuality_reward``, ``nan_reward`` + a counter on ``reward_model``, and
    with ``fail_fast`` the whole batch fails with the reasons."""
    prompts = [f"Tell me about Paris {i}." for i in range(6)]
    responses = [f"Paris is the capital of France. It has {i} airports." for i in range(6)]
    remote = RemoteFactualityReward(stack["url"])
    metrics_url = f"http://127.0.0.1:{stack['cfg'].metrics_port}/metrics"

    def nan_counter() -> float:
        text = urllib.request.urlopen(metrics_url).read().decode()
        lines = [ln for ln in text.splitlines() if ln.startswith("factuality_nan_rewards_total{") and 'reason="error"' in ln]
        return float(lines[0].split()[-1]) if lines else 0.0

    try:
        # 1. the judge process dies after 10 answers (whatever was in flight): every sample is either scored
        #    from real verdicts or NaN with the judge's error, never a default score
        _CALLS["n"], MODE["alive_for"] = 0, 10
        died = remote(prompts, responses)
        assert any(d.get("error") for d in died.details)
        for i, d in enumerate(died.details):
            if d.get("error"):
                assert math.isnan(died.scores[i]) and "HTTP 503" in d["error"] and "judge process died" in d["error"]
            else:
                assert math.isfinite(died.scores[i])
        MODE["alive_for"] = None
        # 2. deterministic: the judge fails for samples 3..5 of the batch; 0..2 keep their real rewards
        MODE["dead_on"] = ("has 3 airports", "has 4 airports", "has 5 airports")
        rich = remote(prompts, responses)
        assert [bool(d.get("error")) for d in rich.details] == [False] * 3 + [True] * 3
        np.testing.assert_allclose(rich.scores[:3], stack["reward"](prompts[:3], responses[:3]).scores, atol=1e-6)
        for i in range(3, 6):
            assert math.isnan(rich.scores[i]) and "judge process died" in rich.details[i]["error"]
            assert not rich.token_rewards[i].any()  # a failed sample carries no token rewards
        # 3. NeMo-Aligner's wire cannot carry NaN: nan_reward, counted (Prometheus) and logged
        before = nan_counter()
        tokens, lengths, _ = aligner_payload(tiny_tokenizer, prompts, responses)
        out = _infer(stack["url"], "reward_model", tokens=tokens, sequence_lengths=lengths)
        assert out["rewards"][3:, 0].tolist() == [stack["cfg"].nan_reward] * 3 and np.all(out["rewards"][:3, 0] != 0)
        assert nan_counter() == before + 3
        # fail_fast: the batch fails as a whole and the caller sees why
        stack["server"].cfg.fail_fast = True
        with pytest.raises(RemoteRewardError, match="fail_fast"):
            remote(prompts, responses)
    finally:
        MODE["alive_for"], MODE["dead_on"] = None, ()
        stack["server"].cfg.fail_fast = False
    assert np.isfinite(remote(prompts[:1], responses[:1]).scores).all()  # the judge is back: real rewards again


def test_readiness_reflects_judge_and_metrics_are_exported(stack):
    base = f"http://127.0.0.1:{stack['cfg'].health_port}"
    assert json.load(urllib.request.urlopen(base + "/health/live"))["live"] is True
    assert json.load(urllib.request.urlopen(base + "/health/ready"))["ready"] is True
    stack["judge"].models_status = 503
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/health/ready")
        body = json.loads(err.value.read())
        assert err.value.code == 503 and "judge:judge" in body["down"] and "HTTP 503" in body["down"]["judge:judge"]
    finally:
        stack["judge"].models_status = 200
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack['cfg'].metrics_port}/metrics").read().decode()
    assert "factuality_requests_total" in text and "factuality_reward_claims_verified" in text
    assert "factuality_batch_latency_seconds_bucket" in text


def test_64_concurrent_clients_each_get_their_own_result_once(stack):
    remote = RemoteFactualityReward(stack["url"])
    samples = [(f"Tell me about city {i}.", f"City {i} has {i} parks. It is old.") for i in range(64)]
    sequential = {i: remote([p], [r]).scores[0] for i, (p, r) in enumerate(samples[:8])}
    results: dict[int, list[float]] = {i: [] for i in range(64)}
    lock = threading.Lock()

    def worker(i):
        p, r = samples[i]
        score = RemoteFactualityReward(stack["url"])([p], [r]).scores[0]
        with lock:
            results[i].append(score)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    deadline = time.time() + 120
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(deadline - time.time(), 0))
    assert all(not t.is_alive() for t in threads), "concurrent requests did not finish within 120 s"
    assert all(len(v) == 1 for v in results.values())
    for i, score in sequential.items():
        assert results[i][0] == pytest.approx(score, abs=1e-6)


def test_client_error_names_url_model_and_key():
    (port,) = free_ports(1)
    with pytest.raises(RemoteRewardError) as err:
        RemoteFactualityReward(f"http://127.0.0.1:{port}", init_timeout_s=1, timeout_s=1)(["p"], ["r"])
    msg = str(err.value)
    assert f"127.0.0.1:{port}" in msg and "factuality_reward" in msg and "reward.timeout_s" in msg


def test_remote_general_rm_reads_a_reward_model_endpoint(stack, tiny_tokenizer):
    """KLCF's general RM as a remote NeMo-Aligner ``reward_model`` endpoint (here: this server's own)."""
    from nemo_factuality.rewards.general_rm import GeneralRMError, build_general_rm

    template = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "{prompt}"}], tokenize=False,
                                                  add_generation_prompt=True) + "{response}"
    rm = build_general_rm({"kind": "remote", "url": stack["url"], "model_name": "reward_model", "template": template})
    scores = rm(PROMPTS[:2], RESPONSES[:2])
    np.testing.assert_allclose(scores, stack["reward"](PROMPTS[:2], RESPONSES[:2]).scores, atol=1e-5)
    assert rm.health() == {f"general_rm:{stack['url']}/reward_model": None}
    with pytest.raises(GeneralRMError, match="general_rm.url"):
        build_general_rm({"kind": "remote", "url": "http://127.0.0.1:9", "timeout_s": 1})(["q"], ["a"])


def _judged(stack, client, prompts, responses):
    before = len(stack["judge"].requests)
    result = client(prompts, responses)
    return result, len(stack["judge"].requests) - before


def test_a_request_resent_after_a_client_timeout_is_answered_not_judged_again(stack):
    """The judges are slow, not gone: the client times out after 1 s and resends while the server still scores the
    first request. The resend carries the same request ids, so the server answers it from the first one's result:
    the judge sees one request's worth of calls (before the ids: two or more)."""
    from nemo_factuality.serving.client import Backoff, RewardServerUnavailable

    patient = RemoteFactualityReward(stack["url"], timeout_s=60)
    hasty = RemoteFactualityReward(stack["url"], timeout_s=1.0, retry=Backoff(max_wait_s=60, initial_s=0.2, max_s=0.5))
    MODE["verify"] = "slow"  # 1.5 s per verification: the first request outlives the 1 s timeout
    try:
        once, single = _judged(stack, patient, PROMPTS[:1], RESPONSES[:1])
        resent, judged = _judged(stack, hasty, PROMPTS[:1], RESPONSES[:1])
        assert judged == single > 0, (judged, single)
        np.testing.assert_array_equal(resent.scores, once.scores)
        assert stack["server"].metrics.repeated_samples.labels(stack["cfg"].rich_model_name)._value.get() >= 1
        # without the ids' memory every resend is judged again, and each outlives the timeout as the first did: the
        # judge load grows with every resend until the retry window closes
        stack["server"].answered.capacity = 0
        brief = RemoteFactualityReward(stack["url"], timeout_s=1.0, retry=Backoff(max_wait_s=3, initial_s=0.2, max_s=0.5))
        before = len(stack["judge"].requests)
        with pytest.raises(RewardServerUnavailable):
            brief(PROMPTS[:1], RESPONSES[:1])
        time.sleep(2)  # the resends still queued on the server finish
        assert len(stack["judge"].requests) - before >= 2 * single
    finally:
        MODE["verify"] = "Correct"
        stack["server"].answered.capacity = stack["cfg"].answered_rows_kept
