"""The real judge client against a real loopback OpenAI-protocol server with scripted failures."""

import threading

import pytest

from nemo_factuality.interfaces import ChatRequest
from nemo_factuality.judge.cache import JudgeCache
from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer

pytestmark = pytest.mark.waits  # mostly on scripted judges' delays (tests/conftest.py gives it the waiting lane)


def _req(text: str, **kw) -> ChatRequest:
    return ChatRequest(({"role": "user", "content": text},), **kw)


def test_concurrency_limit_and_order():
    with ScriptedOpenAIServer(lambda r: Reply(r["messages"][-1]["content"].upper(), delay_s=0.05)) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", concurrency=4)
        replies = client.complete_batch([_req(f"q{i}") for i in range(16)])
        assert [r.text for r in replies] == [f"Q{i}" for i in range(16)]
        assert srv.max_in_flight == 4  # bounded, and the bound is actually used
        assert client.stats.requests == 16 and client.stats.errors == 0
        client.close()


def test_timeout_then_retry_succeeds_and_500_then_success():
    calls = {"slow": 0, "flaky": 0}
    lock = threading.Lock()

    def script(req):
        key = req["messages"][-1]["content"]
        with lock:
            calls[key] += 1
            n = calls[key]
        if key == "slow":
            return Reply("late", delay_s=1.0) if n == 1 else Reply("fast")
        return Reply("boom", status=500) if n <= 2 else Reply("ok")

    with ScriptedOpenAIServer(script) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", timeout_s=0.3, max_retries=3, backoff_s=0.01)
        slow, flaky = client.complete_batch([_req("slow"), _req("flaky")])
        assert slow.ok and slow.text == "fast" and slow.attempts == 2
        assert flaky.ok and flaky.text == "ok" and flaky.attempts == 3
        client.close()


@pytest.mark.parametrize("reply,needle", [
    (Reply("boom", status=503), "HTTP 503"),
    (Reply("", malformed=True), "malformed response body"),
    (Reply("", drop=True), "connection error"),
])
def test_persistent_failures_give_explicit_errors(reply, needle):
    with ScriptedOpenAIServer(lambda r: reply) as srv:
        client = OpenAIJudgeClient(srv.url, "judge-x", max_retries=2, backoff_s=0.01, timeout_s=2)
        (out,) = client.complete_batch([_req("q")])
        assert not out.ok and out.text is None and out.attempts == 3
        assert needle in out.error and srv.url in out.error and "judge-x" in out.error
        assert "judge.timeout_s" in out.error  # says which config key to change
        assert len(srv.requests) == 3 and client.stats.errors == 1
        client.close()


def test_4xx_is_not_retried_and_truncation_is_flagged():
    with ScriptedOpenAIServer(by_substring={"bad": Reply("nope", status=400), "long": Reply("partial", truncated=True)}) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", max_retries=3, backoff_s=0.01)
        bad, long = client.complete_batch([_req("bad"), _req("long")])
        assert not bad.ok and "HTTP 400 (not retried)" in bad.error and bad.attempts == 1
        assert long.ok and long.truncated and long.text == "partial"
        client.close()


def test_cache_persists_across_clients(tmp_path):
    with ScriptedOpenAIServer(lambda r: Reply("Correct")) as srv:
        path = tmp_path / "cache.sqlite"
        c1 = OpenAIJudgeClient(srv.url, "judge", cache=path)
        assert c1.complete_batch([_req("a"), _req("b")])[0].cached is False
        c1.close()
        c2 = OpenAIJudgeClient(srv.url, "judge", cache=JudgeCache(path))
        replies = c2.complete_batch([_req("a"), _req("b"), _req("a", temperature=0.7)])
        assert [r.cached for r in replies] == [True, True, False]  # params are part of the key
        assert len(srv.requests) == 3 and c2.stats.cache_hits == 2
        c2.close()


def test_failures_are_not_cached(tmp_path):
    state = {"n": 0}

    def script(req):
        state["n"] += 1
        return Reply("x", status=500) if state["n"] == 1 else Reply("fine")

    with ScriptedOpenAIServer(script) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", cache=tmp_path / "c.sqlite", max_retries=0)
        assert not client.complete_batch([_req("q")])[0].ok
        assert client.complete_batch([_req("q")])[0].text == "fine"
        client.close()


def test_health_reports_down_endpoint():
    with ScriptedOpenAIServer() as srv:
        assert OpenAIJudgeClient(srv.url, "judge").health() == {"judge:judge": None}
        url = srv.url
    reason = OpenAIJudgeClient(url, "judge", timeout_s=1).health()["judge:judge"]
    assert reason and "unreachable" in reason and url in reason


def test_sync_api_works_inside_a_running_event_loop():
    import asyncio

    with ScriptedOpenAIServer(lambda r: Reply("ok")) as srv:
        client = OpenAIJudgeClient(srv.url, "judge")

        async def caller():
            return client.complete_batch([_req("q")])

        assert asyncio.run(caller())[0].text == "ok"
        client.close()


def test_the_tls_context_is_built_once_per_client(monkeypatch):
    """Loading the CA bundle costs ~50 ms; a reward calls the judge in several batches per micro batch of a step."""
    import httpx

    built = []
    real = httpx.create_ssl_context
    monkeypatch.setattr(httpx, "create_ssl_context", lambda *a, **k: built.append(1) or real(*a, **k))
    with ScriptedOpenAIServer(lambda r: Reply("ok")) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", concurrency=2)
        for _ in range(3):
            assert [r.text for r in client.complete_batch([_req("a"), _req("b")])] == ["ok", "ok"]
        client.close()
    assert built == [1]


def test_the_scripted_judge_prints_nothing_when_a_client_resets_its_connection(capfd):
    """A reward server killed mid-run resets its keep-alive connections to the judge; the stand-in judge (in the test
    process) must not print socketserver's traceback to the stderr a CLI's one-line error check reads."""
    import json
    import socket
    import time

    with ScriptedOpenAIServer(lambda req: Reply("ok")) as srv:
        host, port = srv.url.split("//")[1].split("/")[0].split(":")
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
        conn = socket.create_connection((host, int(port)))
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert b"200" in conn.recv(65536).split(b"\r\n")[0]
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
        conn.close()
        time.sleep(0.5)  # the server thread's read of the next request line meets the reset
        assert srv.url  # still serving
    assert "Traceback" not in capfd.readouterr().err


def test_the_scripted_judge_ignores_a_request_whose_client_died_before_its_body(capfd):
    """A reward server SIGKILLed between a request's headers and its body leaves an empty read at EOF: that is no
    request (the script never sees it, nothing is recorded), not an empty JSON object a script fails on."""
    import socket
    import time

    seen = []
    with ScriptedOpenAIServer(lambda req: seen.append(req) or Reply(req["messages"][-1]["content"])) as srv:
        host, port = srv.url.split("//")[1].split("/")[0].split(":")
        conn = socket.create_connection((host, int(port)))
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 120\r\n\r\n")
        conn.shutdown(socket.SHUT_WR)  # headers sent, then the process is gone
        assert conn.recv(65536) == b""  # closed without an answer
        conn.close()
        time.sleep(0.3)
        client = OpenAIJudgeClient(srv.url, "judge")
        assert [r.text for r in client.complete_batch([_req("still serving")])] == ["still serving"]
        client.close()
        assert len(seen) == 1 and srv.requests == seen
    assert "Traceback" not in capfd.readouterr().err
