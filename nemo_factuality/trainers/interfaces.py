"""One contract per role in a training stage: the policy actor and the critic (NeMo-RL style ``interfaces``).

The stages (``grpo.py``, ``ppo.py``, ``kto.py``) only call these methods, so the same reward →
advantage → loss code drives a tiny HF model on CPU (``backends/hf/actor.py``) and NeMo-Aligner's
Megatron actors with TP/PP/DP (``backends/aligner/actor.py``).

Tensor layout (NeMo-Aligner's, so its actors need no reshaping):

* ``tokens``: ``[B, S]`` int64, prompt followed by response, right-padded with the pad id.
* ``prompt_lengths``: ``[B]`` prompt tokens; ``response_lengths``: ``[B]`` prompt + response tokens
  (Aligner's name; the response includes its EOS when it ended).
* ``is_end``: ``[B]`` bool, the response ended with EOS before the length limit.
* per-token quantities (log-probs, values, advantages, masks) are ``[B, S-1]``: position ``t``
  holds the prediction of ``tokens[:, t+1]``; the response's actions are ``[prompt_len-1, response_len-1)``.

A loss function is backend-agnostic: it receives what the backend's forward produced for one micro
batch (``{"logprobs": [b, S-1]}`` for the actor, ``{"values": [b, S-1]}`` for the critic, plus
``"entropy"`` when asked for) and the micro batch's own tensors, and returns ``(loss, metrics)``.
Losses are already normalised by the *global* token/sequence count of the optimiser step (the
stage puts it in the batch), so a backend just sums gradients over micro batches.

Rollouts stream: ``generate_chunks`` yields each micro batch of sequences (a ``RolloutChunk``: which
prompt rows it holds, and their ``Rollout``) as soon as it is generated, so the stages can send it to
the reward while the next one is generated; ``assemble_rollout`` puts the chunks back in prompt order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample rollouts (NeMo-Aligner's ``sampling_params`` + ``length_params.max_length``)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    use_greedy: bool = False


@dataclass
class Rollout:
    """Generated sequences in Aligner's layout (see module docstring)."""

    tokens: torch.Tensor  # [B, S] int64
    prompt_lengths: torch.Tensor  # [B] int64
    response_lengths: torch.Tensor  # [B] int64, prompt + response (incl. EOS when it ended)
    is_end: torch.Tensor  # [B] bool
    # [B, S-1] float32: the sampling engine's log-prob of tokens[:, t+1] (0 outside the response), when the rollout
    # comes from an engine other than the trainer (rollout.engine=vllm); None for the actor's own generate
    logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = self.tokens.shape[0]
        if self.logprobs is not None and tuple(self.logprobs.shape) != (b, self.tokens.shape[1] - 1):
            raise ValueError(f"Rollout.logprobs has shape {list(self.logprobs.shape)}, expected [{b}, {self.tokens.shape[1] - 1}]")
        for name in ("prompt_lengths", "response_lengths", "is_end"):
            t = getattr(self, name)
            if tuple(t.shape) != (b,):
                raise ValueError(f"Rollout.{name} has shape {list(t.shape)}, expected [{b}]")
        if bool((self.response_lengths < self.prompt_lengths).any()):
            raise ValueError("Rollout.response_lengths must be >= prompt_lengths")
        if bool((self.response_lengths > self.tokens.shape[1]).any()):
            raise ValueError(f"Rollout.response_lengths exceed the sequence length {self.tokens.shape[1]}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def response_ids(self, i: int, *, eos_id: int | None = None) -> list[int]:
        """Response token ids of row ``i`` without the trailing EOS (what the reward sees)."""
        ids = self.tokens[i, int(self.prompt_lengths[i]) : int(self.response_lengths[i])].tolist()
        if ids and bool(self.is_end[i]) and (eos_id is None or ids[-1] == eos_id):
            ids = ids[:-1]
        return ids


@dataclass
class RolloutChunk:
    """One generated micro batch: ``rollout`` row ``j`` answers prompt row ``rows[j]`` of the ``generate_chunks`` call."""

    rows: list[int]
    rollout: Rollout

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.rollout):
            raise ValueError(f"RolloutChunk: {len(self.rows)} row indices for {len(self.rollout)} sequences")


def assemble_rollout(chunks: Sequence[RolloutChunk], pad_id: int) -> Rollout:
    """The chunks of one ``generate_chunks`` call as one ``Rollout`` in prompt-row order, right-padded to one width.

    The chunks' ``rows`` must cover ``0 .. N-1`` exactly once (any order: a backend may bucket prompts by length)."""
    rows = [r for c in chunks for r in c.rows]
    if sorted(rows) != list(range(len(rows))):
        raise ValueError(f"rollout chunks cover rows {sorted(rows)[:8]}…, not each of 0..{len(rows) - 1} once")
    width = max(c.rollout.tokens.shape[1] for c in chunks)
    tokens = torch.cat([torch.nn.functional.pad(c.rollout.tokens, (0, width - c.rollout.tokens.shape[1]), value=pad_id)
                        for c in chunks])
    order = torch.argsort(torch.tensor(rows))  # position of prompt row i among the concatenated chunks
    logprobs = None
    if all(c.rollout.logprobs is not None for c in chunks):
        logprobs = torch.cat([torch.nn.functional.pad(c.rollout.logprobs, (0, width - c.rollout.tokens.shape[1]))
                              for c in chunks])[order]
    return Rollout(tokens=tokens[order], prompt_lengths=torch.cat([c.rollout.prompt_lengths for c in chunks])[order],
                   response_lengths=torch.cat([c.rollout.response_lengths for c in chunks])[order],
                   is_end=torch.cat([c.rollout.is_end for c in chunks])[order], logprobs=logprobs)


def check_train_batch(batch: Mapping[str, torch.Tensor], micro_batch_size: int) -> int:
    """The number of sequences in a ``train_step`` batch, after checking it holds what every actor needs (``tokens``,
    ``prompt_lengths``, ``response_lengths``; the loss function may need more) and splits into micro batches."""
    missing = [k for k in ("tokens", "prompt_lengths", "response_lengths") if k not in batch]
    if missing:
        raise KeyError(f"train_step batch lacks {missing} (has {sorted(batch)})")
    size = int(batch["tokens"].shape[0])
    if size % micro_batch_size:
        raise ValueError(f"a batch of {size} sequences is not a multiple of micro_batch_size={micro_batch_size}")
    return size


#: ``train_step`` batch entries that are per example, not per token, whatever their width: FactAlign's sentence
#: tensors ``[B, K]`` (``kto.pack_examples``), K sentences, which may equal S-1 and must never be cut with the tokens.
PER_EXAMPLE_KEYS = frozenset({"sent_start", "sent_end", "sent_label", "sent_valid"})


def trim_to_longest(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` cut to its longest sequence (no compute on trailing padding): ``tokens [B, S]`` to ``[B, W]`` and
    every per-token ``[B, S-1]`` tensor to ``[B, W-1]``, W the longest ``response_lengths``; the rest as it is."""
    width = int(batch["response_lengths"].max())
    full = batch["tokens"].shape[1]
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if key == "tokens":
            out[key] = value[:, :width]
        elif (key not in PER_EXAMPLE_KEYS and torch.is_tensor(value) and value.dim() == 2
              and value.shape[1] == full - 1):
            out[key] = value[:, : width - 1]
        else:
            out[key] = value
    return out


@runtime_checkable
class PolicyActor(Protocol):
    """The trained policy plus its frozen reference (initial policy) for KL.

    A data-parallel backend also has ``data_parallel_rank``, ``data_parallel_size``, ``global_rank``,
    ``all_reduce_sum(tensor)``, ``global_sum(float)`` and ``barrier()``; the stages reach them only
    through ``trainers.parallel.DataParallel``, which treats an actor without them as world 1.
    """

    tokenizer: Any
    eos_id: int
    pad_id: int

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        """Sample one response per prompt row (repeat rows for ``n`` samples per prompt)."""
        ...

    def generate_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[RolloutChunk]:
        """``generate`` micro batch by micro batch: each chunk is yielded as soon as it is generated.

        ``assemble_rollout(list(generate_chunks(p, s)), pad_id)`` is what ``generate(p, s)`` returns (the
        same random draws in the same order); the stages score one chunk while the next is generated."""
        ...

    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        """``[B, S-1]`` log-probs of the taken tokens under the current policy (no grad)."""
        ...

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """``[B, S-1]`` log-probs under the reference policy (no grad)."""
        ...

    def reset_reference(self) -> None:
        """Make the current weights the reference (FactAlign: each iteration's starting policy)."""
        ...

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int,
                   need_entropy: bool = False) -> dict[str, float]:
        """One optimiser step over ``batch`` (must hold ``tokens``, ``prompt_lengths``, ``response_lengths``).

        Splits into micro batches, sums ``loss_fn`` gradients, clips, steps the optimiser and LR
        schedule; returns the loss functions' metrics averaged over micro batches plus ``grad_norm`` and ``lr``.
        """
        ...

    def save(self, path: Path) -> None:
        """Write the full training state (weights, optimiser, schedule, reference) under ``path``."""
        ...

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote."""
        ...

    def export(self, path: Path) -> None:
        """Write the current policy in the backend's deployable format (HF ``save_pretrained`` / ``.nemo``)."""
        ...


@runtime_checkable
class Critic(Protocol):
    """A value model over the actor's token layout."""

    def values(self, rollout: Rollout) -> torch.Tensor:
        """``[B, S-1]`` value estimates (no grad)."""
        ...

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        """One optimiser step; ``loss_fn`` receives ``{"values": [b, S-1]}``."""
        ...

    def save(self, path: Path) -> None:
        ...

    def load(self, path: Path) -> None:
        ...
