"""The megatron backend's ``Critic`` (PPO / RLFH): a second Megatron-Core ``GPTModel`` in the PPO process, built by
Megatron-Bridge from ``critic.path`` (an HF causal-LM folder; null = the policy's ``model.path``) on the actor's
TP/PP/DP process groups, its vocabulary output layer replaced by a scalar value head.

* The head is the hf backend's (``HFCritic``: transformers' token-classification ``score``): a linear layer with bias
  from the final-norm hidden state to one value per token, ``[s, b, h] → [s, b, 1]``; zero (every value starts at 0)
  when the critic starts from the policy (RLFH / OpenRLHF), else as transformers initialises a new ``score``
  (normal(0, ``initializer_range``) weight, zero bias; the same draw on every rank, seeded by ``trainer.seed``).
* Tied embeddings: the head never shares the word embedding. The model is set untied before DDP wraps it
  (``share_embeddings_and_output_weights`` off), so no embedding is passed to the head (it refuses one) and no gradient
  is all-reduced between the first and last pipeline stage for a tie that no longer exists; the last stage's copy of a
  tied embedding goes with the output layer it was.
* Pipeline: only the last stage holds the head; values are sent from it to every stage of the replica.
* Tensor parallelism: the head is replicated over the TP ranks (its input, the final-norm output, is the same on each
  with sequence parallelism off), not split: Megatron counts a replicated parameter's gradient once in the norm (on TP
  rank 0), and each rank computes the same gradient for its copy, so the copies stay equal.
* Optimiser and checkpoints: ``model.MegatronModel``, as the actor's — its own optimiser and schedule from
  ``critic.optim``, clipped at ``trainer.gradient_clip_val``, the distributed optimizer with
  ``model.megatron.use_distributed_optimizer``; ``save`` writes ``critic/`` inside the stage's checkpoint directory
  (one commit with the actor's files: the checkpointer renames the directory when both are written).

Importing this module imports nothing from Megatron.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.trainers.backends.megatron import build
from nemo_factuality.trainers.backends.megatron.model import MegatronModel
from nemo_factuality.trainers.interfaces import LossFn, Rollout

CRITIC_DIR = "critic"


class ValueHead(torch.nn.Module):
    """The critic's output layer in place of GPTModel's ``output_layer``: ``[s, b, h]`` hidden states → ``([s, b, 1]``
    values, ``None)``, the output layer's call and return shape. Replicated over TP ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)  # [1, h]
        self.bias = torch.nn.Parameter(bias)  # [1]
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if weight is not None:  # GPTModel passes the word embedding when the model is still tied
            raise RuntimeError("the value head was handed a shared output weight: the critic's model is still tied")
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # [s/TP, b, h] → [s, b, h]. Every TP rank then computes the same values and the same loss, so the backward
            # keeps this rank's slice of the input gradient (no reduce-scatter, which would sum TP identical copies)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def head_weights(hidden: int, *, zero: bool, initializer_range: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([1, hidden], [1])``: zeros, or transformers' initialisation of a new ``score`` layer (normal(0,
    ``initializer_range``), zero bias) drawn from a generator of its own (the same on every rank)."""
    weight = torch.zeros(1, hidden)
    if not zero:
        weight.normal_(0.0, initializer_range, generator=torch.Generator().manual_seed(seed))
    return weight, torch.zeros(1)


def install_value_head(weight: torch.Tensor, bias: torch.Tensor) -> Callable[[list[Any]], list[Any]]:
    """A Bridge pre-wrap hook: every chunk untied, the last pipeline stage's output layer a ``ValueHead``."""

    def install(chunks: list[Any]) -> list[Any]:
        for chunk in chunks:
            chunk.share_embeddings_and_output_weights = False
            if chunk.pre_process:  # its word embedding is no longer shared with an output layer
                embedding = chunk.embedding.word_embeddings.weight
                for attr in ("shared_embedding", "zero_out_wgrad"):
                    if hasattr(embedding, attr):
                        delattr(embedding, attr)
            if chunk.post_process:
                like = next(chunk.parameters())
                chunk.output_layer = ValueHead(weight.to(like.device, like.dtype), bias.to(like.device, like.dtype),
                                               sequence_parallel=chunk.config.sequence_parallel)
        return chunks

    return install


class MegatronCritic(MegatronModel):
    """``Critic`` on Megatron-Core (module docstring); one instance per rank, built after the actor (same layout)."""

    def __init__(self, cfg: Any, policy_path: str, *, tensor: int, pipeline: int, max_steps: int,
                 distributed_timeout_s: float, gradient_clip_val: float = 1.0, seed: int = 1234, device: str = "cpu",
                 settings: build.Settings | None = None) -> None:
        """``settings``: the policy's (``model.dtype``, ``model.megatron.*``: the critic is trained as the policy is)."""
        path = cfg.path or policy_path
        self.cfg = cfg
        self.settings = settings or build.Settings()
        self.layout = build.init_process_groups(tensor, pipeline, device, seed, distributed_timeout_s,
                                                gloo=self.settings.gloo_process_groups)
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        weight, bias = head_weights(int(config["hidden_size"]), zero=cfg.path is None,
                                    initializer_range=float(config.get("initializer_range", 0.02)), seed=seed)
        with torch.random.fork_rng(devices=[]):  # the stage's random stream (rollouts) is the actor's to draw from
            self.bridge, self.chunks = build.build_model(path, self.layout, self.settings, on_gpu=device.startswith("cuda"),
                                                         after_load=install_value_head(weight, bias))
        self.model = build.bare_model(self.chunks[0])
        self._setup_training(cfg.optim, max_steps=max_steps, gradient_clip_val=gradient_clip_val, role="critic",
                             lr_key="critic.optim.lr")

    @staticmethod
    def _values(output: torch.Tensor) -> torch.Tensor:
        """``[b, S, 1]`` head output → ``[b, S-1]``: the value of the state after ``tokens[:, :t+1]``, aligned with the
        log-prob positions (``HFCritic._values``)."""
        return output[:, :-1, 0].float()

    def values(self, rollout: Rollout) -> torch.Tensor:
        """``[B, S-1]`` values (no grad), in micro batches of ``critic.micro_batch_size``; every rank of the replica."""
        return self._per_token(rollout, self.cfg.micro_batch_size, lambda output, _tokens: self._values(output), 0)

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        """One optimiser step of ``loss_fn`` on ``{"values": [b, S-1]}``: its metrics averaged over micro batches and
        data-parallel ranks, and ``grad_norm`` — what ``HFCritic`` returns (the actor's ``loss`` and ``lr`` keys are
        the actor's in the stage's metrics)."""
        metrics = self._train_step(batch, loss_fn, micro_batch_size, lambda output, _mb: {"values": self._values(output)})
        metrics.pop("loss")
        metrics.pop("lr")
        return metrics

    def save(self, path: Path) -> None:
        """Weights + optimiser + schedule under ``path/critic/`` (collective)."""
        self.save_model(Path(path) / CRITIC_DIR)
        self.barrier()

    def load(self, path: Path) -> None:
        """What ``save`` wrote, at this run's layout (any TP/PP/DP)."""
        where = Path(path) / CRITIC_DIR
        if not where.is_dir():
            raise FileNotFoundError(f"{path} has no {CRITIC_DIR}/: not written by a PPO run on trainer.backend=megatron")
        self.load_model(where)
