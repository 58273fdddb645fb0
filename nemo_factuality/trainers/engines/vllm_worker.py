"""``rollout.vllm.refit=broadcast``: the weight stream from the trainer into the vLLM engine's workers, both ends.

Imports only torch: the engine's workers import this module (``LLM(worker_extension_cls=...)``) in the engine's
venv, which has none of the toolkit's dependencies, and the trainer imports it for the sending side.

The group is a process group of its own, built as a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object (the trainer's
and vLLM's default groups already exist in their processes): rank 0 is the trainer's model-parallel source rank,
ranks 1..T the engine's T workers, rendezvous on a ``TCPStore`` the trainer hosts on loopback (the engine runs on the
replica's node). ``gloo`` when the engine's model is on CPU, ``nccl`` on CUDA — the only difference, so the CPU tests
execute the code the GPU runs.

One refit, after the JSON request that carries the manifest (``[name, dtype, shape]`` per tensor): per tensor a
header ``int64[2] = [manifest index, 0]`` then the tensor itself (manifest shape and dtype), both broadcast from rank 0;
``[-1, tensors sent]`` ends the stream, ``[-2, 0]`` aborts it (the trainer's export failed: the workers raise and the
engine keeps its previous weights only as far as nothing was loaded yet). Joining the group ends with one warm-up
header ``[-3, 0]``: NCCL builds its communicator lazily, inside the first collective, so the join's own broadcast —
bounded on the trainer's side like every stream broadcast — is where an engine that dies while joining shows. The index lets the actor yield in its own
order (Bridge's export order is not the checkpoint's) while every tensor's layout is known before it arrives.

Every reload, streamed or from the refit file, ends with ``retie_output_layers``: a tied output layer (SmolLM2,
Qwen2.5 0.5B–3B, Llama-3.2 1B/3B) is re-derived from the reloaded embedding and checked against it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

END, ABORT, WARM_UP = -1, -2, -3


def collective_versions() -> dict[str, str | None]:
    """What the two ends of a refit group must share: torch's version (gloo is built into it) and NCCL's (None
    without CUDA). The trainer's image and the engine's venv can carry different builds (NGC's torch and NCCL beside
    the pip NCCL wheel), and NCCL refuses a communicator across versions."""
    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return {"torch": torch.__version__, "nccl": nccl}


def versions_problem(backend: str, trainer: dict[str, Any], engine: dict[str, Any]) -> str | None:
    """Why a ``backend`` group cannot form between these two ends (None when it can): NCCL's versions must match,
    and under gloo torch's.

    >>> versions_problem("nccl", {"torch": "2.9.0a0+nv25.06", "nccl": "2.27.3"}, {"torch": "2.9.0", "nccl": "2.26.2"})
    'NCCL 2.27.3 (torch 2.9.0a0+nv25.06) on the trainer, NCCL 2.26.2 (torch 2.9.0) on the engine'
    >>> versions_problem("gloo", {"torch": "2.13.0+cpu", "nccl": None}, {"torch": "2.13.0+cpu", "nccl": None}) is None
    True
    """
    key = "nccl" if backend == "nccl" else "torch"
    if trainer.get(key) == engine.get(key):
        return None
    if key == "nccl":
        return (f"NCCL {trainer.get('nccl')} (torch {trainer.get('torch')}) on the trainer, NCCL {engine.get('nccl')} "
                f"(torch {engine.get('torch')}) on the engine")
    return f"torch {trainer.get('torch')} (its gloo) on the trainer, torch {engine.get('torch')} on the engine"


def make_group(store: Any, prefix: str, rank: int, world: int, backend: str, timeout_s: float, device: Any) -> Any:
    """The refit group's ``rank`` of ``world``: its keys under ``prefix`` on ``store`` (a fresh prefix per engine
    start: a restarted engine forms a new group on the same store); ops that wait past ``timeout_s`` raise."""
    timeout = datetime.timedelta(seconds=timeout_s)
    pstore = torch.distributed.PrefixStore(prefix, store)
    if backend == "gloo":
        opts = torch.distributed.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return torch.distributed.ProcessGroupGloo(pstore, rank, world, opts)
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(pstore, rank, world, opts)
    raise ValueError(f"refit group backend {backend!r}: gloo (CPU) or nccl (CUDA)")


def broadcast(group: Any, tensor: torch.Tensor, *, deadline: float | None = None,
              peer_alive: Callable[[], bool] | None = None) -> None:
    """``tensor`` from rank 0 to every rank of ``group``, in place. Without ``deadline`` it waits (the group's timeout
    bounds it: the engine's side). The trainer's side passes a ``time.monotonic()`` deadline and ``peer_alive``: the
    host polls the collective instead of trusting ``wait()`` — under NCCL ``wait()`` only orders the GPU stream, so a
    peer that died mid-stream went unnoticed until the watchdog tore the process down — and a dead engine process or
    the deadline raise here, the same restart path as gloo's errors."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    work = group.broadcast([tensor], opts)
    if deadline is None:
        work.wait()
        return
    pause = 0.0002
    while not work.is_completed():
        if peer_alive is not None and not peer_alive():
            raise RuntimeError("the engine process exited during the refit broadcast")
        if time.monotonic() > deadline:
            raise RuntimeError("the refit broadcast did not complete before its deadline (rollout.vllm.reply_timeout_s)")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    work.wait()  # raises the collective's own error, if it ended in one


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` → ``torch.float32`` (the manifest's JSON spelling)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"manifest dtype {name!r} is not a torch dtype")
    return dtype


def receive(group: Any, manifest: Sequence[Sequence[Any]], device: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors rank 0 streams, ``(name, tensor)`` in the order sent, each allocated from its manifest entry on
    ``device``; ends at the end header (raises if the count differs from what rank 0 says it sent)."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    received = 0
    while True:
        broadcast(group, header)
        index, count = (int(v) for v in header.tolist())
        if index == END:
            if count != received:
                raise RuntimeError(f"refit stream: rank 0 sent {count} tensors, {received} arrived")
            return
        if index == ABORT:
            raise RuntimeError("refit stream aborted by the trainer (its weight export failed)")
        name, dtype, shape = manifest[index]
        tensor = torch.empty([int(s) for s in shape], dtype=torch_dtype(dtype), device=device)
        broadcast(group, tensor)
        received += 1
        yield name, tensor


class BroadcastRefit:
    """vLLM worker extension (``worker_extension_cls``): its methods run on every engine worker through
    ``collective_rpc``. ``join_refit_group`` once per engine start, ``receive_refit`` per streamed refit,
    ``retie_output_layers`` after every reload (``receive_refit`` calls it; the file refit asks for it)."""

    def join_refit_group(self, host: str, port: int, prefix: str, world: int, backend: str, timeout_s: float) -> None:
        store = torch.distributed.TCPStore(host, int(port), is_master=False,
                                           timeout=datetime.timedelta(seconds=timeout_s))
        rank = 1 + int(self.rank)  # the trainer is rank 0; vLLM's workers are 0..T-1 in its own groups
        self._refit_device = self.model_runner.device
        self._refit_group = make_group(store, prefix, rank, int(world), backend, timeout_s, self._refit_device)
        header = torch.zeros(2, dtype=torch.int64, device=self._refit_device)
        broadcast(self._refit_group, header)  # the warm-up: the communicator forms here, within the group's timeout
        if int(header[0]) != WARM_UP:
            raise RuntimeError(f"refit group: expected the warm-up header, got {header.tolist()}")

    def receive_refit(self, manifest: list[list[Any]]) -> dict[str, Any]:
        """Feed the stream to ``reload_weights`` (checkpoint names and layout; ``load_weights`` fails on CPU, whose
        linear weights are repacked), then re-tie; returns the tensors received and the layers re-tied."""
        seen = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for item in receive(self._refit_group, manifest, self._refit_device):
                seen[0] += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return {"received": seen[0], "retied": self.retie_output_layers()}

    def retie_output_layers(self) -> list[str]:
        """After each reload (both refit modes): ``retie_output_layers`` on this worker's model."""
        return retie_output_layers(self.model_runner.get_model())


#: How far a tied output layer's logits may lie from the embedding's own matmul, relative to their largest magnitude:
#: float32 kernels in another summation order agree to ~1e-6 (576-wide rows); a stale layer after one training step is
#: off by the step's relative change of the embedding.
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
TIE_TOLERANCE_HALF = 2e-2  # bfloat16 / float16: one rounding of the logits


def tied_output_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """``(name, layer, owner)`` for each vocabulary layer whose own ``weight`` is an earlier one's (vLLM's
    ``lm_head.tie_weights(embed_tokens)``: the output layer holds the embedding's parameter), in module order. Only
    output layers (those with ``tie_weights``: ``ParallelLMHead``) are reported; the layer they share with is any
    earlier holder of the tensor (the embedding, ``VocabParallelEmbedding``, has no ``tie_weights`` — filtering the
    owners by it too found no tie at all, so nothing was re-tied: vLLM 0.32, SmolLM2 and the tiny tied Qwen2)."""
    owners: dict[int, torch.nn.Module] = {}
    tied = []
    for name, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        # every weight's first holder is its owner: the embedding (``VocabParallelEmbedding``, which has no
        # ``tie_weights`` of its own) comes first; a later output layer (``ParallelLMHead``) holding it is tied
        owner = owners.setdefault(id(weight), module)
        if owner is not module and hasattr(module, "tie_weights"):
            tied.append((name, module, owner))
    return tied


def retie_output_layers(model: torch.nn.Module) -> list[str]:
    """Re-derive each tied output layer from the embedding it shares after an in-place reload, then check that its
    logits are the embedding's matmul; returns the layers' names (raises when one does not follow: the refit fails
    with the reason instead of rolling out with a stale output layer).

    Why it is needed (vLLM 0.32): the reload loads the shared tensor once, into the embedding — ``AutoWeightsLoader``
    skips ``lm_head.weight``, its alias — and the layerwise reload runs ``process_weights_after_loading`` only for
    layers that loaded something, so the output layer's never runs again. On CPU that step is where the output layer's
    GEMM packs its weight into a buffer of its own (``dispatch_cpu_unquantized_gemm``: a oneDNN handle for float32, the
    sgl kernel's packed copy for bfloat16 on AMX), which it keeps computing with: the shared ``weight`` holds the new
    values, the logits come from the starting ones. On CUDA the unquantized method leaves the weight as it is and the
    matmul reads it, so there the tie already held and this only checks it."""
    names = []
    for name, layer, owner in tied_output_layers(model):
        method = getattr(layer, "quant_method", None)
        if type(method).__name__ != "UnquantizedEmbeddingMethod":  # its processing may not be safe to repeat
            raise RuntimeError(f"refit: the tied output layer {name} uses {type(method).__name__}; re-tying it after a "
                               "reload is done for unquantized output layers only")
        method.process_weights_after_loading(layer)
        gap = output_layer_gap(layer, owner)
        tolerance = TIE_TOLERANCE.get(owner.weight.dtype, TIE_TOLERANCE_HALF)
        if not gap <= tolerance:
            raise RuntimeError(f"refit: the tied output layer {name} does not follow the reloaded embedding (logits "
                               f"{gap:.2e} apart relative to their largest, tolerance {tolerance:g})")
        names.append(name)
    return names


@torch.no_grad()
def output_layer_gap(layer: torch.nn.Module, owner: torch.nn.Module) -> float:
    """``max |layer(x) - x Wᵀ| / max |x Wᵀ|`` on two fixed random hidden states ``x [2, H]``, ``W [V, H]`` the
    owner's weight: how far the output layer's kernel is from the embedding it is tied to."""
    weight = owner.weight
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    got = layer.quant_method.apply(layer, x).float()
    want = torch.nn.functional.linear(x, weight).float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float32).tiny))
