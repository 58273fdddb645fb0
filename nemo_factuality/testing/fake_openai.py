"""A real HTTP server on loopback that speaks the OpenAI protocol with scripted replies.

Tests and benchmarks point the real judge client at it, so timeouts, retries, malformed bodies,
truncated completions and dropped connections all go through the production code path::

    def script(req: dict) -> Reply:
        prompt = req["messages"][-1]["content"]
        return Reply("Correct") if "Paris" in prompt else Reply("Wrong", delay_s=0.05)

    with ScriptedOpenAIServer(script) as server:
        client = OpenAIJudgeClient(server.url, "judge")
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """How the server answers one request."""

    text: str = ""
    delay_s: float = 0.0  # sleep before answering (timeouts, latency hiding)
    status: int = 200  # HTTP status (500 → retry path, 400 → no-retry path)
    malformed: bool = False  # a body that is not JSON
    truncated: bool = False  # finish_reason "length"
    drop: bool = False  # close the connection without any response
    logprobs: list[dict[str, Any]] | None = None  # chat logprobs content entries, returned verbatim


ScriptFn = Callable[[dict], "Reply | str"]


class _Server(ThreadingHTTPServer):
    # The socketserver default backlog of 5 drops bursts of new connections (clients then wait ~1 s
    # for a SYN retransmit), which would make high-concurrency runs look slow for the wrong reason.
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-request (a reward server killed by an outage test) is the client's event, not
        # the server's error; socketserver would print its traceback to stderr, where a CLI's one-line check reads.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


@dataclass
class _State:
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class ScriptedOpenAIServer:
    """Threaded OpenAI-compatible server (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``).

    Args:
        script: ``fn(request_json) -> Reply | str``; called per request (from server threads).
        by_substring: alternative to ``script``: the first key found in the last message picks the reply.
        default: reply when no substring matches.
        model: the model id listed by ``/v1/models``.
        require_model: answer a completion request for any other ``model`` with 404, as vLLM does for a name
            it does not serve (its ``--served-model-name``).
        host, port: where to listen (default: loopback, a free port).
    """

    def __init__(self, script: ScriptFn | None = None, *, by_substring: Mapping[str, Reply | str] | None = None,
                 default: Reply | str = "", model: str = "judge", require_model: bool = False,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.script = script
        self.by_substring = dict(by_substring or {})
        self.default = default
        self.model = model
        self.require_model = require_model
        self.address = (host, port)
        self.state = _State()
        self.models_status = 200  # set to e.g. 503 to make health checks (GET /v1/models) fail
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> ScriptedOpenAIServer:
        handler = _make_handler(self)
        self._httpd = _Server(self.address, handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="scripted-openai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._httpd = self._thread = None

    def __enter__(self) -> ScriptedOpenAIServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        """Base URL ending in ``/v1`` (what OpenAI clients and vLLM users configure)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[dict]:
        with self.state.lock:
            return list(self.state.requests)

    @property
    def max_in_flight(self) -> int:
        return self.state.max_in_flight

    # ---------------------------------------------------------------- replies
    def reply_for(self, request: dict) -> Reply:
        if self.script is not None:
            out = self.script(request)
        else:
            text = _last_text(request)
            out = next((r for key, r in self.by_substring.items() if key in text), self.default)
        return Reply(out) if isinstance(out, str) else out


def _last_text(request: dict) -> str:
    if "messages" in request and request["messages"]:
        return str(request["messages"][-1].get("content", ""))
    return str(request.get("prompt", ""))


def _completion_body(request: dict, reply: Reply, chat: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if reply.truncated else "stop"}
    if chat:
        choice["message"] = {"role": "assistant", "content": reply.text}
        if reply.logprobs is not None:
            choice["logprobs"] = {"content": reply.logprobs}
    else:
        choice["text"] = reply.text
    return {
        "id": f"cmpl-{int(time.time() * 1e6)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.get("model", "judge"),
        "choices": [choice],
        "usage": {"prompt_tokens": len(_last_text(request).split()), "completion_tokens": len(reply.text.split()),
                  "total_tokens": len(_last_text(request).split()) + len(reply.text.split())},
    }


def _make_handler(server: ScriptedOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out as separate writes; without TCP_NODELAY, Nagle plus the peer's
            # delayed ACK adds ~40 ms to every keep-alive response.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, fmt: str, *args: Any) -> None:  # keep test output clean
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") in ("/v1/models", "/models") and server.models_status != 200:
                self._send(server.models_status, b'{"error": "scripted outage"}')
            elif self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, json.dumps({"object": "list", "data": [{"id": server.model, "object": "model"}]}).encode())
            elif self.path.rstrip("/") == "/health":
                self._send(200, b"{}")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length)
            if len(body) < length:  # the client died between its headers and its body (a killed server's judge
                self.close_connection = True  # client): nobody to answer, and an empty body is no request
                return
            try:
                request = json.loads(body or b"{}")
            except json.JSONDecodeError:
                self._send(400, b'{"error": "invalid JSON"}')
                return
            chat = self.path.rstrip("/").endswith("chat/completions")
            if not chat and not self.path.rstrip("/").endswith("/completions"):
                self._send(404, b'{"error": "not found"}')
                return
            if server.require_model and request.get("model") != server.model:
                message = f"The model `{request.get('model')}` does not exist."  # vLLM's answer, verbatim shape
                self._send(404, json.dumps({"object": "error", "message": message, "code": 404}).encode())
                return
            st = server.state
            with st.lock:
                st.requests.append(request)
                st.in_flight += 1
                st.max_in_flight = max(st.max_in_flight, st.in_flight)
            try:
                reply = server.reply_for(request)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                if reply.drop:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if reply.malformed:
                    self._send(reply.status, b'{"choices": [ {"message": ')
                elif reply.status != 200:
                    self._send(reply.status, json.dumps({"error": {"message": reply.text or "scripted error"}}).encode())
                else:
                    self._send(200, json.dumps(_completion_body(request, reply, chat)).encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout); nothing to answer
            finally:
                with st.lock:
                    st.in_flight -= 1

    return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve scripted replies from a separate process (benchmarks; the Slurm stand-in's judges).

    ``python -m nemo_factuality.testing.fake_openai --replies '{"needle": "text"}' --default X --delay-ms 50``
    or ``--script nemo_factuality.testing.methods:method_judge`` (a ``fn(request) -> Reply | str`` by module path);
    ``--host/--port`` where to listen (default loopback, a free port); ``--served-model-name NAME`` answers only
    requests for NAME, as ``vllm serve --served-model-name`` does. Prints ``PORT <n>`` once listening, then serves
    until SIGTERM.
    """
    import argparse
    import importlib

    ap = argparse.ArgumentParser(prog="python -m nemo_factuality.testing.fake_openai")
    ap.add_argument("--replies", default="{}", help="JSON object: substring of the last message -> reply text")
    ap.add_argument("--default", default="")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--script", default=None, metavar="MODULE:FUNCTION", help="reply function (instead of --replies)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--served-model-name", default=None, help="the only model name served (default: any name)")
    args = ap.parse_args(argv)
    delay = args.delay_ms / 1000
    replies = {k: Reply(v, delay_s=delay) for k, v in json.loads(args.replies).items()}
    script = None
    if args.script:
        module, _, func = args.script.partition(":")
        script = getattr(importlib.import_module(module), func)
    server = ScriptedOpenAIServer(script, by_substring=replies, default=Reply(args.default, delay_s=delay),
                                  model=args.served_model_name or "judge", require_model=args.served_model_name is not None,
                                  host=args.host, port=args.port)
    serve_until_terminated(server)


def serve_until_terminated(server: ScriptedOpenAIServer) -> None:
    """Start ``server``, print ``PORT <n>`` (what a parent process waits for) and serve until SIGTERM."""
    import signal

    server.start()
    print(f"PORT {server.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
