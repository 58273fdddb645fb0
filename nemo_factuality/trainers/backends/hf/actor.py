"""The ``hf`` backend: a transformers causal LM as ``PolicyActor`` and a token-value model as ``Critic`` (CPU or one GPU).

Reference policy: ``reference="copy"`` keeps a frozen copy of the initial weights;
``"cpu_weight_swap"`` keeps them as a CPU state dict and swaps them into the model for reference
log-probs, as NeMo-Aligner does, so only one set of weights sits on the accelerator.

Sampling is exactly the stage's: ``generate`` sees only ``model.sampling_params`` (temperature, top-k, top-p,
greedy) and ``max_length``, never the checkpoint's ``generation_config.json`` (Qwen2.5-Instruct ships
repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7; others add suppressed or bad words), which
transformers would otherwise merge into every call: the rollouts would not come from π. Log-probs (old,
reference, training) and the entropy are of the distribution sampled from: the same transformers warpers
(temperature, top-k, top-p: ``SampledDistribution``) run in ``generate`` and before every ``log_softmax``, so the
PPO/GRPO ratio is of what was sampled; greedy rollouts use the plain ``softmax(logits)``.

Checkpoints are safetensors (weights) plus ``torch.save`` files of plain tensors/dicts for the optimiser and
schedule, always read back with ``weights_only=True``: no code runs on load. The reference is not copied while
it is the initial checkpoint (GRPO, PPO): ``reference.json`` records ``model.path`` and its fingerprint
(``trainers/reference.py``); after ``reset_reference`` (KTO) it is ``reference.safetensors``.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nemo_factuality.trainers import reference as ref_record
from nemo_factuality.trainers.backends.collectives import ProcessGroupDataParallel, sum_gradients
from nemo_factuality.trainers.backends.hf.compiled import GraphLog, compiled_config, padded_prompts
from nemo_factuality.trainers.config import CriticModelConfig, OptimConfig, PolicyModelConfig
from nemo_factuality.trainers.interfaces import LossFn, Rollout, RolloutChunk, SamplingParams, trim_to_longest

log = logging.getLogger(__name__)


class _NoLoadReport(logging.Filter):
    """Drops transformers' LOAD REPORT table (``HFCritic``: the keys it lists are checked there instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_optimizer(params: Sequence[torch.nn.Parameter], cfg: OptimConfig, max_steps: int):
    """AdamW/SGD plus a constant or warmup+cosine schedule (to ``min_lr``) over ``max_steps`` optimiser steps."""
    params = [p for p in params if p.requires_grad]
    if cfg.name == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, max_steps, step))


def lr_factor(cfg: OptimConfig, max_steps: int, step: int) -> float:
    """The learning rate of optimiser step ``step`` (0-based) as a fraction of ``cfg.lr``: linear warm-up over
    ``sched.warmup_steps``, then constant or cosine to ``sched.min_lr`` at ``max_steps`` (every backend's schedule)."""
    warmup, floor = cfg.sched.warmup_steps, cfg.sched.min_lr / cfg.lr if cfg.lr else 0.0
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.sched.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class SampledDistribution:
    """The distribution rollouts are drawn from: ``softmax`` of the logits after transformers' own warpers, in
    ``generate``'s order — temperature, then top-k, then top-p (none of them for greedy decoding).

    ``generate`` runs exactly ``processors()`` (passed as its ``logits_processor``, the generation config's own set
    to no-ops) and every log-prob goes through ``log_softmax`` with the same warpers, so the PPO/GRPO ratio and the
    KL are of what was sampled (log-probs of the full distribution under top-k/top-p made the ratio wrong)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @classmethod
    def of(cls, sampling: Any) -> SampledDistribution:
        """From ``SamplingParams`` (stage or config: ``use_greedy``, ``temperature``, ``top_k``, ``top_p``)."""
        if sampling.use_greedy:
            return cls()
        return cls(float(sampling.temperature), int(sampling.top_k or 0), float(sampling.top_p))

    def scaling(self) -> list[Any]:
        from transformers import TemperatureLogitsWarper

        return [TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else []

    def truncation(self) -> list[Any]:
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        return ([TopKLogitsWarper(self.top_k)] if self.top_k > 0 else []) + \
               ([TopPLogitsWarper(self.top_p)] if self.top_p < 1.0 else [])

    def processors(self) -> Any:
        from transformers import LogitsProcessorList

        return LogitsProcessorList(self.scaling() + self.truncation())

    def _warped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scaled, truncated) ``[N, V]`` float32 scores: after the temperature; after top-k/top-p too (-inf = cut)."""
        scaled = logits.float().reshape(-1, logits.shape[-1])
        for warper in self.scaling():
            scaled = warper(None, scaled)  # the warpers read only the scores, never the input ids
        kept = scaled
        for warper in self.truncation():
            kept = warper(None, kept)
        return scaled, kept

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits → float32 log-probs of the sampled distribution. A token the truncation cuts — a prompt
        or padding position, or a sampled token a later policy (or the reference) would not keep — gets its log-prob
        under the scaled distribution instead of -inf: masked positions stay finite (0 · -inf is NaN in every sum)
        and such a token's ratio stays bounded rather than 0 or infinite."""
        scaled, kept = self._warped(logits)
        if kept is scaled:  # no truncation
            return F.log_softmax(scaled, dim=-1).reshape(logits.shape)
        out = torch.where(torch.isfinite(kept), F.log_softmax(kept, dim=-1), F.log_softmax(scaled, dim=-1))
        return out.reshape(logits.shape)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` next-token logits → ``[N]`` tokens drawn from this distribution (torch's default generator), as
        ``generate`` draws them; a backend with its own decoding loop samples through this."""
        _, kept = self._warped(logits)
        return torch.multinomial(F.softmax(kept, dim=-1), num_samples=1).view(-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits → ``[...]`` entropy of the sampled distribution (cut tokens have probability 0)."""
        _, kept = self._warped(logits)
        logp = F.log_softmax(kept, dim=-1)
        # zero the -inf log-probs before the product, not after: d(p·log p)/d(log p) at -inf is 0·-inf = NaN, and
        # torch.where would carry that NaN into the gradient
        finite_logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
        return -(logp.exp() * finite_logp).sum(-1).reshape(logits.shape[:-1])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   distribution: SampledDistribution = SampledDistribution()) -> torch.Tensor:
    """``[b, S, V]`` logits, ``[b, S]`` tokens → ``[b, S-1]`` log-probs of tokens[:, t+1] under ``distribution``."""
    logp = distribution.log_softmax(logits[:, :-1])
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def stage_generation_config(sampling: SamplingParams, eos_id: int, pad_id: int) -> Any:
    """A ``GenerationConfig`` holding only the stage's length and sampling mode: every logits processor transformers
    would add from it or a checkpoint's ``generation_config.json`` is set to its no-op value, temperature, top-k and
    top-p included (``SampledDistribution.processors`` applies those, the same objects the log-probs use)."""
    from transformers import GenerationConfig

    neutral = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
               "encoder_no_repeat_ngram_size": 0, "length_penalty": 1.0, "min_new_tokens": 0,
               "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1, "num_beam_groups": 1,
               "diversity_penalty": 0.0, "renormalize_logits": False, "num_return_sequences": 1}
    return GenerationConfig(max_new_tokens=sampling.max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
                            do_sample=not sampling.use_greedy, temperature=1.0, top_k=0, top_p=1.0, **neutral)


def attention_mask(tokens: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return (pos < response_lengths.to(tokens.device).unsqueeze(1)).long()


def _cpu_copy(model: Any) -> dict[str, torch.Tensor]:
    """A CPU copy of every tensor (tied weights become separate copies, which safetensors requires)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def _micro_batches(batch: Mapping[str, torch.Tensor], size: int):
    n = batch["tokens"].shape[0]
    for start in range(0, n, size):
        yield {k: v[start : start + size] for k, v in batch.items()}


def _backward_micro_batches(batch: Mapping[str, torch.Tensor], size: int, device: torch.device, loss_fn: LossFn,
                            forward: Any) -> dict[str, float]:
    """Forward + ``loss_fn`` + backward per micro batch (gradients add up); the loss metrics averaged over them."""
    sums: dict[str, float] = {}
    n_micro = 0
    for mb in _micro_batches(batch, size):
        mb = trim_to_longest(mb)
        loss, metrics = loss_fn(forward(mb), {k: v.to(device) for k, v in mb.items()})
        loss.backward()
        n_micro += 1
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return {k: v / max(n_micro, 1) for k, v in sums.items()}


class HFActor(ProcessGroupDataParallel):
    """``PolicyActor`` over ``AutoModelForCausalLM`` (see ``trainers/interfaces.py`` for the contract).

    Data parallelism: under torchrun with several processes (``collectives.init_from_environment``) each rank holds
    a full replica; gradients are summed over the ranks before clipping (the stages' losses are normalised by the
    global counts), so every replica takes the same step. Each rank samples from its own random stream (the seed
    offset by its rank), and only global rank 0 writes checkpoint and export files.
    """

    def __init__(self, cfg: PolicyModelConfig, *, max_steps: int, gradient_clip_val: float = 1.0, device: str = "cpu",
                 model: Any = None, tokenizer: Any = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nemo_factuality.local_models import from_pretrained

        self.cfg, self.device, self.gradient_clip_val = cfg, torch.device(device), gradient_clip_val
        self.tokenizer = tokenizer or from_pretrained(AutoTokenizer.from_pretrained, cfg.path, "model.path")
        self.model = model or from_pretrained(AutoModelForCausalLM.from_pretrained, cfg.path, "model.path",
                                              dtype=_DTYPES[cfg.dtype])
        self.model.to(self.device)
        self._graphs = GraphLog() if cfg.hf_generation == "compiled" else None
        if self.data_parallel_size > 1:
            torch.manual_seed(torch.initial_seed() + self.data_parallel_rank)  # replicas sample different rollouts
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer at {cfg.path} has no eos_token; set one so responses can end")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.distribution = SampledDistribution.of(cfg.sampling_params)  # log-probs of what is sampled
        self.optimizer, self.scheduler = build_optimizer(list(self.model.parameters()), cfg.optim, max_steps)
        self._ref_model: Any = None
        self._ref_state: dict[str, torch.Tensor] | None = None
        self.reset_reference()
        # the reference is the checkpoint at model.path until reset_reference(): checkpoints record it, not copy it
        self.initial_reference = ref_record.initial_record(cfg.path, "model.path") if model is None and cfg.path else None
        self.reference_is_initial = self.initial_reference is not None

    # ------------------------------------------------------------------ reference policy
    def reset_reference(self) -> None:
        self.reference_is_initial = False
        if self.cfg.reference == "copy":
            self._ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        else:
            self._ref_state = _cpu_copy(self.model)

    def _set_reference(self, state: dict[str, torch.Tensor]) -> None:
        if self._ref_model is not None:
            self._ref_model.load_state_dict(state)
        else:
            self._ref_state = state

    def _reference_state(self) -> dict[str, torch.Tensor]:
        if self._ref_model is not None:
            return _cpu_copy(self._ref_model)
        assert self._ref_state is not None
        return self._ref_state

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate: every prompt needs at least one token")
        self.model.eval()
        compiled = self.cfg.hf_generation == "compiled"
        if compiled:  # fixed shapes: one compiled graph per prompt-width bucket (backends/hf/compiled.py)
            left, mask = padded_prompts(prompt_ids, self.pad_id, max(1, self.cfg.rollout_micro_batch_size))
        else:
            left, mask = padded_prompts(prompt_ids, self.pad_id, 0, bucket=1)
        width = left.shape[1]
        asked = SampledDistribution.of(sampling)
        if not sampling.use_greedy and asked != self.distribution:
            raise ValueError(f"generate: sampling from {asked} but the log-probs are of {self.distribution} "
                             "(model.sampling_params: temperature, top_k, top_p)")
        from transformers import GenerationConfig

        # transformers fills what a passed config leaves unset from model.generation_config (the checkpoint's file):
        # a blank one stands in for it during the call, and the stage's config sets every processor to a no-op
        checkpoint_config, self.model.generation_config = self.model.generation_config, GenerationConfig()
        config = stage_generation_config(sampling, self.eos_id, self.pad_id)
        if compiled:
            config = compiled_config(config, self.device)
        try:
            out = self.model.generate(input_ids=left.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config, logits_processor=asked.processors()).cpu()
        finally:
            self.model.generation_config = checkpoint_config
        if compiled:
            self._graphs.after(*left.shape, sampling.max_new_tokens)
        return self._to_rollout(prompt_ids, out[: len(prompt_ids), width:])

    def generate_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[RolloutChunk]:
        """``generate`` over consecutive slices of ``model.rollout_micro_batch_size`` prompt rows, each yielded when done."""
        size = max(1, self.cfg.rollout_micro_batch_size)
        for start in range(0, len(prompt_ids), size):
            rows = list(range(start, min(start + size, len(prompt_ids))))
            yield RolloutChunk(rows, self.generate([prompt_ids[i] for i in rows], sampling))

    def _to_rollout(self, prompt_ids: Sequence[Sequence[int]], generated: torch.Tensor) -> Rollout:
        """Left-padded generate output → Aligner's right-padded layout, cut after the first EOS."""
        rows, ends = [], []
        for p, gen in zip(prompt_ids, generated.tolist(), strict=False):
            if self.eos_id in gen:
                gen, ended = gen[: gen.index(self.eos_id) + 1], True
            else:
                ended = False
            rows.append(list(p) + gen)
            ends.append(ended)
        seq = max(len(r) for r in rows)
        tokens = torch.full((len(rows), seq), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return Rollout(tokens, torch.tensor([len(p) for p in prompt_ids]), torch.tensor([len(r) for r in rows]),
                       torch.tensor(ends, dtype=torch.bool))

    # ------------------------------------------------------------------ log-probs
    def _forward_logprobs(self, model: Any, tokens: torch.Tensor, lengths: torch.Tensor,
                          need_entropy: bool = False) -> dict[str, torch.Tensor]:
        tokens = tokens.to(self.device)
        logits = model(input_ids=tokens, attention_mask=attention_mask(tokens, lengths)).logits
        out = {"logprobs": token_logprobs(logits, tokens, self.distribution)}
        if need_entropy:
            out["entropy"] = self.distribution.entropy(logits[:, :-1])
        return out

    @torch.no_grad()
    def _logprobs_with(self, model: Any, rollout: Rollout) -> torch.Tensor:
        model.eval()
        out = torch.zeros(rollout.tokens.shape[0], rollout.tokens.shape[1] - 1)
        size = self.cfg.forward_micro_batch_size
        for start in range(0, len(rollout), size):
            sl = slice(start, start + size)
            width = int(rollout.response_lengths[sl].max())
            lp = self._forward_logprobs(model, rollout.tokens[sl, :width], rollout.response_lengths[sl])["logprobs"]
            out[sl, : width - 1] = lp.float().cpu()
        return out

    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        return self._logprobs_with(self.model, rollout)

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        if self._ref_model is not None:
            return self._logprobs_with(self._ref_model, rollout)
        current = _cpu_copy(self.model)
        self.model.load_state_dict(self._reference_state())
        try:
            return self._logprobs_with(self.model, rollout)
        finally:
            self.model.load_state_dict(current)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int,
                   need_entropy: bool = False) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = _backward_micro_batches(
            batch, micro_batch_size, self.device, loss_fn,
            lambda mb: self._forward_logprobs(self.model, mb["tokens"], mb["response_lengths"], need_entropy))
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.data_parallel_size > 1:
            sum_gradients(params)
            metrics = self.mean_over_ranks(metrics)
        clip = self.gradient_clip_val if self.gradient_clip_val > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()} in the policy update; lower "
                                     "model.optim.lr or check the reward for inf values")
        self.optimizer.step()
        self.scheduler.step()
        metrics.update(grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        return metrics

    # ------------------------------------------------------------------ state
    def save(self, path: Path) -> None:
        """Global rank 0 writes (every replica holds the same weights and optimiser state)."""
        from safetensors.torch import save_file

        if self.global_rank != 0:
            return
        path.mkdir(parents=True, exist_ok=True)
        save_file(_cpu_copy(self.model), path / "policy.safetensors")
        if self.reference_is_initial:
            ref_record.write_record(path, self.initial_reference)
        else:
            save_file(self._reference_state(), path / "reference.safetensors")
            ref_record.write_record(path, ref_record.stored_record("reference.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   path / "policy_optim.pt")

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(path / "policy.safetensors"))
        record = ref_record.read_record(path) or ref_record.stored_record("reference.safetensors")  # older checkpoints
        if record["kind"] == "initial":
            initial_path = ref_record.check_initial(record, self.cfg.path, path)
            if not self.reference_is_initial:  # only a reset in this process moves it; rebuild it from the path
                from transformers import AutoModelForCausalLM

                initial = AutoModelForCausalLM.from_pretrained(initial_path, dtype=_DTYPES[self.cfg.dtype])
                self._set_reference(_cpu_copy(initial))
                self.reference_is_initial = True
        else:
            self._set_reference(load_file(path / record["where"]))
            self.reference_is_initial = False
        state = torch.load(path / "policy_optim.pt", weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def load_weights(self, path: Path) -> None:
        """Only the policy weights of a checkpoint (early stopping's restore of the best step)."""
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(path / "policy.safetensors"))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights in the checkpoint's tensor names, CPU copies (a rollout engine's refit by file)."""
        return _cpu_copy(self.model)

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in the checkpoint's tensor names, the live tensors (no copy: a streamed refit sends
        each before the next optimiser step)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def hf_weights_manifest(self) -> list[tuple[str, str, list[int]]]:
        """``[name, dtype, shape]`` of each tensor ``hf_weights`` yields (a streamed refit's manifest)."""
        return [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in self.model.state_dict().items()]

    def export(self, path: Path) -> None:
        """An HF folder (global rank 0 writes it; every rank returns once it is complete)."""
        from nemo_factuality.fileio import respect_umask

        if self.global_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(str(path))
            self.tokenizer.save_pretrained(str(path))
            respect_umask(path)  # safetensors writes 0600 through a temporary file: the policy is an ordinary output
        self.barrier()


class HFCritic(ProcessGroupDataParallel):
    """``Critic``: the policy's backbone with a one-output token head (``AutoModelForTokenClassification``).

    Initialised from ``critic.path`` or, by default, from the policy checkpoint with a zero value head
    (RLFH/OpenRLHF initialise the critic from the policy; a zero head starts every value at 0).
    """

    def __init__(self, cfg: CriticModelConfig, policy_path: str, *, max_steps: int, gradient_clip_val: float = 1.0,
                 device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import AutoConfig, AutoModelForTokenClassification

        from nemo_factuality.local_models import from_pretrained

        path, key = (cfg.path, "critic.path") if cfg.path else (policy_path, "model.path")
        self.cfg, self.device, self.gradient_clip_val = cfg, torch.device(device), gradient_clip_val
        config = from_pretrained(AutoConfig.from_pretrained, path, key, num_labels=1)
        config.classifier_dropout = 0.0  # transformers' default 0.1 would make values noisy in train mode
        # transformers' LOAD REPORT table calls the value head a missing weight and the policy's lm_head unexpected,
        # which a critic made from the policy has by design: the table is left out of this load (a filter, not the
        # logger's level, which transformers 5.24 reads as "verify the tensor-parallel plan" and warns again), and
        # what differs from that is said below in one line
        loader = logging.getLogger("transformers.modeling_utils")
        quiet = _NoLoadReport()
        loader.addFilter(quiet)
        try:
            self.model, info = from_pretrained(AutoModelForTokenClassification.from_pretrained, path, key, config=config,
                                               dtype=_DTYPES[dtype], output_loading_info=True)
        finally:
            loader.removeFilter(quiet)
        by_design = ({"score."}, {"lm_head."}) if cfg.path is None else (set(), set())
        surprises = [k for kind, prefixes in zip(("missing_keys", "unexpected_keys"), by_design, strict=True)
                     for k in info.get(kind, ()) if not k.startswith(tuple(prefixes))]
        if surprises:
            log.warning("critic from %s (%s): %d weights missing or unexpected beyond the value head: %s", path, key,
                        len(surprises), ", ".join(sorted(surprises)[:8]))
        if cfg.path is None:
            with torch.no_grad():
                for p in self.model.score.parameters():
                    p.zero_()
        self.model.to(self.device)
        self.optimizer, self.scheduler = build_optimizer(list(self.model.parameters()), cfg.optim, max_steps)

    def _values(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device)
        out = self.model(input_ids=tokens, attention_mask=attention_mask(tokens, lengths)).logits[..., 0]
        return out[:, :-1].float()  # value of the state after tokens[:, :t+1], aligned with log-prob positions

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(rollout.tokens.shape[0], rollout.tokens.shape[1] - 1)
        for start in range(0, len(rollout), self.cfg.micro_batch_size):
            sl = slice(start, start + self.cfg.micro_batch_size)
            width = int(rollout.response_lengths[sl].max())
            out[sl, : width - 1] = self._values(rollout.tokens[sl, :width], rollout.response_lengths[sl]).cpu()
        return out

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = _backward_micro_batches(batch, micro_batch_size, self.device, loss_fn,
                                          lambda mb: {"values": self._values(mb["tokens"], mb["response_lengths"])})
        if self.data_parallel_size > 1:  # as the actor's: the stage's value loss is normalised by the global counts
            sum_gradients(list(self.model.parameters()))
            metrics = self.mean_over_ranks(metrics)
        clip = self.gradient_clip_val if self.gradient_clip_val > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        metrics["grad_norm"] = float(grad_norm)
        return metrics

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        if self.global_rank != 0:  # every replica holds the same critic
            return
        path.mkdir(parents=True, exist_ok=True)
        save_file(_cpu_copy(self.model), path / "critic.safetensors")
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   path / "critic_optim.pt")

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(path / "critic.safetensors"))
        state = torch.load(path / "critic_optim.pt", weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
