"""FactAlign: iterated sample → label → KTO + sentence-level fKTO (arXiv 2410.01691 §3).

    nemo-factuality train kto --config-name factalign model.path=/models/gemma2b data.train=prompts.jsonl \
        data.general_pairs=ultrafeedback_pairs.jsonl
    python -m nemo_factuality.trainers.kto --config-name factalign remote_rm.url=$FACTUALITY_REWARD_URL

Each of ``kto.num_iterations`` iterations:

1. the current policy becomes the reference (the iteration's starting policy);
2. ``kto.prompts_per_iteration`` prompts × ``kto.samples_per_prompt`` samples are generated and labelled
   by the FactAlign labeller: response label ``f1@K > t`` and one label per fact-bearing sentence
   (with its character span). A sample the labeller could not judge (NaN) is dropped, never guessed;
3. the labelled samples are mixed with general preference pairs (chosen = desirable, rejected =
   undesirable; ``kto.general_data_ratio`` pairs per labelled sample);
4. ``kto.epochs_per_iteration`` epochs of ``L = L_KTO + λ·L_fKTO`` in minibatches of
   ``model.global_batch_size``: ``L_KTO`` over response log-ratios ``Σ_t log π/π_ref`` with reference
   point ``z0`` from mismatched prompt/completion pairs of the minibatch, ``L_fKTO`` over sentence
   log-ratios (the sentence's token range) with its own ``z0_f``; both averaged over the minibatch's
   global example / sentence counts;
5. ``validate(step)``, when the caller passes one (the lab's model selection), and its metrics are logged.

Checkpoints hold the iteration's labelled data, so a resumed run continues mid-iteration.

Data parallelism: each rank samples and labels its slice of the iteration's prompts; the labelled
examples are gathered so every rank holds the same set (what the labeller dropped differs per rank),
every rank draws the same global minibatch and trains on its share of it (padded with weight-0 rows to
equal shares, so the ranks' optimiser steps line up), and z0 / z0_f are the global minibatch's
(all-reduced sums over the mismatched pairs).

Reference log-probs (``kto.precompute_reference``): once per iteration, in one forward pass split over the
data-parallel ranks, for the examples and for the mismatched pairs of every minibatch of every epoch (the
minibatch draws are seeded, so they are known when the data is); an optimiser step then runs one extra
no-grad forward (the policy's half of z0), not two and a ``cpu_weight_swap``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from nemo_factuality.algorithms import kto_losses, response_mask
from nemo_factuality.config import ConfigError
from nemo_factuality.text.alignment import align_tokens
from nemo_factuality.trainers.config import KTOConfig
from nemo_factuality.trainers.data import PreferencePair, PromptRecord, PromptSampler
from nemo_factuality.trainers.interfaces import PolicyActor, Rollout, RolloutChunk, SamplingParams, assemble_rollout
from nemo_factuality.trainers.parallel import DataParallel, data_parallel_problems
from nemo_factuality.trainers.resume import model_identity
from nemo_factuality.trainers.runtime import (
    Checkpointer,
    PhaseTimer,
    PreemptionFlag,
    RunLogger,
    StepStart,
    TrainingStalledError,
    checkpoint_if_server_gone,
    completions_of,
    encode_prompts,
)
from nemo_factuality.trainers.scoring import RolloutScorer
from nemo_factuality.types import FactualityInputError, RewardBatch

log = logging.getLogger(__name__)
_GEN_CHUNK = 64  # rows per generate() and labeller call while collecting an iteration's samples


def sentence_token_ranges(tokenizer: Any, completion: str, ids: Sequence[int], spans: Sequence[Any],
                          prompt_len: int) -> list[tuple[int, int]]:
    """Character spans of a completion → ``[start, end)`` action positions in the ``[S-1]`` log-prob layout."""
    if not spans:
        return []
    alignment = align_tokens(tokenizer, completion, list(ids))
    out = []
    for span in spans:
        first, end = alignment.token_range(span)
        out.append((prompt_len - 1 + first, prompt_len - 1 + end))
    return out


def pack_examples(rows: list[list[int]], prompt_lens: list[int], desirable: list[bool],
                  sentences: list[list[tuple[int, int, bool]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Examples → padded tensors: tokens ``[N, S]``, lengths ``[N]``, labels ``[N]``, sentences ``[N, K]``."""
    n, width = len(rows), max(len(r) for r in rows)
    k = max([len(s) for s in sentences] + [1])
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    out = {"sent_start": torch.zeros(n, k, dtype=torch.long), "sent_end": torch.zeros(n, k, dtype=torch.long),
           "sent_label": torch.zeros(n, k, dtype=torch.bool), "sent_valid": torch.zeros(n, k, dtype=torch.bool)}
    for i, (r, sents) in enumerate(zip(rows, sentences, strict=True)):
        tokens[i, : len(r)] = torch.tensor(r)
        for j, (start, end, label) in enumerate(sents):
            out["sent_start"][i, j], out["sent_end"][i, j] = start, end
            out["sent_label"][i, j], out["sent_valid"][i, j] = label, True
    out.update(tokens=tokens, prompt_lengths=torch.tensor(prompt_lens), response_lengths=torch.tensor([len(r) for r in rows]),
               desirable=torch.tensor(desirable, dtype=torch.bool))
    return out


def rank_rows(n: int, rank: int, size: int, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of an ``n``-row global minibatch: ``positions [L]`` into it and ``weight [L]`` (1 or 0).

    The minibatch is padded to a multiple of ``size × micro_batch_size`` with weight-0 copies of row 0, so
    every rank runs the same number of micro batches (the collective steps line up) whatever the labeller
    dropped, every micro batch is full (the megatron and aligner actors take equal micro batches only: a
    last minibatch of 3 rows with micro batches of 2 was refused at DP=1), and the padding adds nothing to
    the loss or to z0."""
    per = math.ceil(n / (size * micro_batch_size)) * micro_batch_size
    positions = torch.cat([torch.arange(n), torch.zeros(per * size - n, dtype=torch.long)])
    weight = torch.cat([torch.ones(n), torch.zeros(per * size - n)])
    return positions[rank * per : (rank + 1) * per], weight[rank * per : (rank + 1) * per]


def sentence_sums(diff: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``Σ_{t ∈ [start, end)} diff[i, t]`` for every ``(i, k)``: ``[b, T]``, ``[b, K]`` → ``[b, K]`` (prefix sums)."""
    prefix = torch.nn.functional.pad(diff.cumsum(-1), (1, 0))
    return prefix.gather(1, end.clamp(max=diff.shape[1])) - prefix.gather(1, start.clamp(max=diff.shape[1]))


def mismatched(batch: Mapping[str, torch.Tensor], pad_id: int) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """Prompt ``i`` with completion ``i+1`` (mod b): KTO's KL pairs. Returns (rollout, sentence starts, ends)."""
    b = batch["tokens"].shape[0]
    rows, plens, starts, ends = [], [], [], []
    for i in range(b):
        j = (i + 1) % b
        pi, pj, rj = int(batch["prompt_lengths"][i]), int(batch["prompt_lengths"][j]), int(batch["response_lengths"][j])
        rows.append(batch["tokens"][i, :pi].tolist() + batch["tokens"][j, pj:rj].tolist())
        plens.append(pi)
        shift = pi - pj
        starts.append(batch["sent_start"][j] + shift)
        ends.append(batch["sent_end"][j] + shift)
    width = max(len(r) for r in rows)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    rollout = Rollout(tokens, torch.tensor(plens), torch.tensor([len(r) for r in rows]), torch.ones(b, dtype=torch.bool))
    return rollout, torch.stack(starts).clamp(min=0), torch.stack(ends).clamp(min=0)


class KTOTrainer:
    stage = "kto"

    def __init__(self, cfg: KTOConfig, actor: PolicyActor, labeller: Any, prompts: Sequence[PromptRecord], *,
                 general_pairs: Sequence[PreferencePair] = (), run_dir: Path,
                 validate: Callable[[int], Mapping[str, float]] | None = None) -> None:
        self.cfg, self.actor, self.labeller, self.prompts = cfg, actor, labeller, list(prompts)
        self.validate = validate  # called with the optimiser step after each iteration; its metrics are logged
        self.pairs = list(general_pairs)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.prompt_ids = encode_prompts(self.prompts, actor.tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_tokens)
        self.sampler = PromptSampler(len(self.prompts), cfg.trainer.seed)
        self.parallel = DataParallel(actor)
        problems = data_parallel_problems(self.parallel.size, "kto.prompts_per_iteration", cfg.kto.prompts_per_iteration,
                                          None, cfg.model.global_batch_size, cfg.model.micro_batch_size)
        if problems:
            raise ConfigError("invalid training config for data parallelism: " + "; ".join(problems))
        self.checkpointer = Checkpointer(self.run_dir, cfg.exp_manager.save_top_k, self.parallel,
                                         identity=model_identity(cfg))
        self.logger = RunLogger(self.run_dir, cfg.exp_manager, cfg, enabled=self.parallel.is_writer)
        self.step = self.iteration = self.position = 0  # optimiser steps; iteration; minibatch index in the iteration
        self.data: dict[str, torch.Tensor] | None = None
        self._pending: dict[str, float] = {}
        self.desirable_frac = math.nan  # the current iteration's share of desirable labelled samples (its step lines)
        self.last_data: dict[str, torch.Tensor] | None = None
        m = cfg.model
        self.sampling = SamplingParams(m.length_params.max_length, m.sampling_params.temperature, m.sampling_params.top_p,
                                       m.sampling_params.top_k, m.sampling_params.use_greedy)

    # ------------------------------------------------------------------ sample → label
    def sample_and_label(self, prompt_rows: Sequence[int]) -> tuple[Rollout, RewardBatch, dict[str, float]]:
        """Samples for ``prompt_rows`` (indices into the prompts) and the labeller's verdicts on them, row for row.

        Generated and labelled in groups of ``_GEN_CHUNK`` rows; with ``kto.overlap_reward`` a group is labelled in
        a worker while the next one is generated (the same labeller calls either way)."""
        records = [self.prompts[i] for i in prompt_rows]
        chunks = []
        with RolloutScorer(self.labeller, records, self.actor.tokenizer, self.actor.eos_id, self.parallel,
                           overlap=self.cfg.kto.overlap_reward) as scorer:

            def generate() -> None:
                desc = f"kto iteration {self.iteration + 1}/{self.cfg.kto.num_iterations}: sample+label"
                for start in tqdm(range(0, len(prompt_rows), _GEN_CHUNK), desc=desc,
                                  disable=not (self.cfg.trainer.progress_bar and self.parallel.is_writer)):
                    rows = list(range(start, min(start + _GEN_CHUNK, len(prompt_rows))))
                    chunks.append(RolloutChunk(rows, self.actor.generate([self.prompt_ids[prompt_rows[r]] for r in rows],
                                                                         self.sampling)))
                    scorer.submit(chunks[-1])

            self.parallel.agreed(generate)  # a replica's engine gone past its restarts stops every rank alike
            labels = scorer.result()
        times = {"time/reward": scorer.reward_s, "time/reward_exposed": scorer.exposed_s}
        if labels.components.get("label") is None or labels.sentence_labels is None or labels.sentence_spans is None:
            raise FactualityInputError("the KTO stage needs a labeller that returns `label`, sentence_labels and "
                                       "sentence_spans (reward.name=factalign)")
        return assemble_rollout(chunks, self.actor.pad_id), labels, times

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Generate, label and pack this iteration's examples (labelled samples + general pairs), with their
        reference log-probs (``iteration_references``).

        Under data parallelism each rank samples and labels its slice of the iteration's prompts; the
        labelled examples are then gathered, so every rank holds the same global set (and counts)."""
        k = self.cfg.kto
        picked = self.parallel.shard(self.sampler.take(k.prompts_per_iteration))
        prompt_rows = [i for i in picked for _ in range(k.samples_per_prompt)]
        rollout, labels, times = self.sample_and_label(prompt_rows)
        completions, ids = completions_of(rollout, self.actor.tokenizer, self.actor.eos_id)
        label = labels.components["label"]
        rows, plens, desirable, sentences = [], [], [], []
        n_labelled = n_dropped = n_good = 0
        for i in range(len(rollout)):
            if math.isnan(float(label[i])) or math.isnan(float(labels.scores[i])):
                n_dropped += 1  # the labeller could not judge it: no label rather than a guessed one
                continue
            plen, rlen = int(rollout.prompt_lengths[i]), int(rollout.response_lengths[i])
            try:
                ranges = sentence_token_ranges(self.actor.tokenizer, completions[i], ids[i], labels.sentence_spans[i], plen)
            except FactualityInputError as err:  # its ids do not align to its text: this sample alone is dropped
                log.warning("kto: sample %d dropped, its sentences cannot be placed on its tokens: %s", i, err)
                n_dropped += 1
                continue
            rows.append(rollout.tokens[i, :rlen].tolist())
            plens.append(plen)
            desirable.append(bool(label[i]))
            sentences.append([(s, e, bool(lab)) for (s, e), lab in zip(ranges, labels.sentence_labels[i], strict=False) if e > s])
            n_labelled += 1
            n_good += bool(label[i])
        if self.parallel.size > 1:  # ranks' lists in rank order: the same global set on every rank
            parts = self.parallel.gather((rows, plens, desirable, sentences, n_labelled, n_dropped, n_good))
            rows, plens, desirable, sentences = ([x for part in parts for x in part[j]] for j in range(4))
            n_labelled, n_dropped, n_good = (sum(part[j] for part in parts) for j in (4, 5, 6))
        n_pairs = min(len(self.pairs), int(round(k.general_data_ratio * n_labelled / 2))) if self.pairs else 0
        if n_pairs:
            order = np.random.default_rng([self.cfg.trainer.seed, self.iteration]).permutation(len(self.pairs))[:n_pairs]
            for pair in (self.pairs[int(i)] for i in order):
                rec = PromptRecord(pair.prompt, [{"role": "user", "content": pair.prompt}], where=pair.where)
                p_ids = encode_prompts([rec], self.actor.tokenizer, self.cfg.data.apply_chat_template,
                                       self.cfg.data.max_prompt_tokens)[0]
                for text, good in ((pair.chosen, True), (pair.rejected, False)):
                    resp = self.actor.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.actor.eos_id]
                    rows.append(p_ids + resp)
                    plens.append(len(p_ids))
                    desirable.append(good)
                    sentences.append([])
        if not rows:  # general pairs come in proportion to labelled samples: none labelled, nothing to train on
            raise TrainingStalledError(f"iteration {self.iteration}: the labeller could not label any of the "
                                       f"{len(prompt_rows) * self.parallel.size} samples (failed judges or abstentions); "
                                       "check the reward server / judge health")
        stats = {"kto/labelled": float(n_labelled), "kto/dropped_unlabelled": float(n_dropped),
                 "kto/desirable_frac": n_good / max(n_labelled, 1), "kto/general_pairs": float(n_pairs),
                 "kto/sentences": float(sum(len(s) for s in sentences))}
        stats.update(times)
        data = pack_examples(rows, plens, desirable, sentences, self.actor.pad_id)
        if k.precompute_reference:
            data.update(self.iteration_references(data))
        else:  # every rank, the whole set; z0's pairs get theirs at every optimiser step
            data["ref_logprobs"] = self.actor.reference_logprobs(_as_rollout(data))
        return data, stats

    # ------------------------------------------------------------------ reference log-probs, once per iteration
    def iteration_references(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reference policy's log-probs the iteration's optimiser steps need, in one forward pass split over the
        data-parallel ranks (each rank its contiguous part of the sequences, then gathered):

        * ``ref_logprobs`` ``[N, S-1]``: the examples';
        * ``kl_ref_resp`` ``[N, E]`` and ``kl_ref_sent`` ``[N, E, K]``: for every epoch ``e`` of the iteration, the
          response and sentence sums of the mismatched pair (z0's KL estimate) whose prompt is example ``i``'s in
          its minibatch (``_minibatch``): the policy's half is computed at the step, ``z0 = mean(Σ log π − these)``.
        """
        n, e_count = data["tokens"].shape[0], self.cfg.kto.epochs_per_iteration
        pairs = [self._mismatched_pairs(data, epoch, index) for epoch in range(e_count)
                 for index in range(math.ceil(n / self.cfg.model.global_batch_size))]
        pairs = [p for p in pairs if p is not None]
        seqs = [data["tokens"][i, : int(data["response_lengths"][i])] for i in range(n)]
        seqs += [p["tokens"][j, : int(p["response_lengths"][j])] for p in pairs for j in range(len(p["anchor"]))]
        plens = torch.cat([data["prompt_lengths"], *[p["prompt_lengths"] for p in pairs]])
        mine = self.parallel.split(range(len(seqs)))
        k = data["sent_start"].shape[1]
        part = self._reference_part(seqs, plens, mine, n, pairs, k)
        full, resp, sent = (torch.cat(x) for x in zip(*self.parallel.gather(part), strict=True))
        out = {"ref_logprobs": torch.zeros(n, data["tokens"].shape[1] - 1),
               "kl_ref_resp": torch.zeros(n, e_count, dtype=torch.float64),
               "kl_ref_sent": torch.zeros(n, e_count, k, dtype=torch.float64)}
        out["ref_logprobs"][:, : full.shape[1]] = full[:, : data["tokens"].shape[1] - 1]
        anchor, epoch = (torch.cat([p[key] for p in pairs]) if pairs else torch.zeros(0, dtype=torch.long)
                         for key in ("anchor", "epoch"))
        out["kl_ref_resp"][anchor, epoch] = resp
        out["kl_ref_sent"][anchor, epoch] = sent
        return out

    def _reference_part(self, seqs: Sequence[torch.Tensor], plens: torch.Tensor, mine: Sequence[int], n: int,
                        pairs: Sequence[Mapping[str, torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's share of ``iteration_references``: the full log-probs of its example rows (``< n``) and the
        response / sentence sums (``[P]``, ``[P, k]``) of its pair rows (``≥ n``)."""
        width = max(len(x) for x in seqs)
        if not mine:
            return torch.zeros(0, width - 1), torch.zeros(0, dtype=torch.float64), torch.zeros(0, k, dtype=torch.float64)
        tokens = torch.full((len(mine), width), self.actor.pad_id, dtype=torch.long)
        for row, i in enumerate(mine):
            tokens[row, : len(seqs[i])] = seqs[i]
        lengths = torch.tensor([len(seqs[i]) for i in mine])
        rollout = Rollout(tokens, plens[list(mine)], lengths, torch.ones(len(mine), dtype=torch.bool))
        ref = self.actor.reference_logprobs(rollout)
        examples = torch.tensor([i < n for i in mine])
        starts = torch.cat([p["starts"] for p in pairs]) if pairs else torch.zeros(0, k, dtype=torch.long)
        ends = torch.cat([p["ends"] for p in pairs]) if pairs else torch.zeros(0, k, dtype=torch.long)
        pair_rows = torch.tensor([i - n for i in mine if i >= n], dtype=torch.long)
        ref_pairs, ro_pairs = ref[~examples], Rollout(tokens[~examples], rollout.prompt_lengths[~examples],
                                                      lengths[~examples], rollout.is_end[~examples])
        mask = response_mask(ro_pairs.prompt_lengths, ro_pairs.response_lengths, ref.shape[1]).double()
        # float64 sums: z0 is a small difference of two large sums of log-probs
        return (ref[examples], (ref_pairs.double() * mask).sum(-1),
                sentence_sums(ref_pairs.double(), starts[pair_rows], ends[pair_rows]))

    def _minibatch(self, n: int, epoch: int, index: int) -> torch.Tensor:
        """Indices (into the iteration's ``n`` examples) of minibatch ``index`` of ``epoch``: every rank draws the
        same, seeded by the iteration and epoch."""
        size = self.cfg.model.global_batch_size
        order = torch.from_numpy(np.random.default_rng([self.cfg.trainer.seed, self.iteration, epoch]).permutation(n))
        return order[index * size : (index + 1) * size]

    def _mismatched_pairs(self, data: Mapping[str, torch.Tensor], epoch: int, index: int) -> dict[str, torch.Tensor] | None:
        """The z0 pairs of one minibatch (None for a minibatch of one example: it has no z0), with the example each
        pair's prompt comes from (``anchor``) and the epoch."""
        idx = self._minibatch(data["tokens"].shape[0], epoch, index)
        if len(idx) < 2:
            return None
        pairs, starts, ends = mismatched({key: v[idx] for key, v in data.items()}, self.actor.pad_id)
        return {"tokens": pairs.tokens, "prompt_lengths": pairs.prompt_lengths, "response_lengths": pairs.response_lengths,
                "starts": starts, "ends": ends, "anchor": idx, "epoch": torch.full((len(idx),), epoch, dtype=torch.long)}


    # ------------------------------------------------------------------ loss
    def loss_fn(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], *, z0: float, z0_f: float,
                n_examples: float, n_sentences: float) -> tuple[torch.Tensor, dict[str, float]]:
        k = self.cfg.kto
        diff = out["logprobs"] - mb["ref_logprobs"]
        mask = response_mask(mb["prompt_lengths"], mb["response_lengths"], diff.shape[1])
        resp = (diff * mask).sum(-1)
        z0_t = diff.new_tensor(z0)
        terms = kto_losses(resp, mb["desirable"], z0_t, beta=k.beta, w_desirable=k.w_desirable, w_undesirable=k.w_undesirable)
        if "weight" in mb:  # data-parallel padding rows (weight 0) add nothing
            terms = terms * mb["weight"].to(terms.dtype)
        l_kto = terms.sum() / n_examples
        sent = sentence_sums(diff, mb["sent_start"], mb["sent_end"])[mb["sent_valid"]]
        loss = l_kto
        metrics = {"loss/kto": l_kto.item()}
        # every micro batch (and rank) reports the same keys, even one without sentences of its own
        if n_sentences > 0:
            l_f = kto_losses(sent, mb["sent_label"][mb["sent_valid"]], diff.new_tensor(z0_f), beta=k.beta_f,
                             w_desirable=k.w_f_desirable, w_undesirable=k.w_f_undesirable).sum() / n_sentences
            loss = loss + k.lam * l_f
            metrics["loss/fkto"] = l_f.item()
        return loss, metrics

    def _reference_points(self, mb: Mapping[str, torch.Tensor], positions: torch.Tensor, weight: torch.Tensor,
                          epoch: int) -> tuple[float, float]:
        """``z0`` and ``z0_f``: detached mean log-ratios of mismatched prompt/completion pairs of the global
        minibatch ``mb``, clamped at 0. Each rank computes the pairs at its ``positions`` ``[L]`` (weight 0:
        padding); the sums and counts are all-reduced, so z0 is the global minibatch's on every rank. The
        reference's sums were computed once for the iteration (``kl_ref_resp`` / ``kl_ref_sent``, epoch ``epoch``);
        without them (``kto.precompute_reference=false``) the reference log-probs are computed here."""
        pairs, starts, ends = mismatched(mb, self.actor.pad_id)
        sent_valid = mb["sent_valid"][(torch.arange(len(pairs)) + 1) % len(pairs)][positions] & (weight > 0).unsqueeze(1)
        rollout = Rollout(pairs.tokens[positions], pairs.prompt_lengths[positions], pairs.response_lengths[positions],
                          pairs.is_end[positions])
        logprobs = self.actor.logprobs(rollout)
        mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, logprobs.shape[1])
        if "kl_ref_resp" in mb:  # float64: a small difference of two large sums
            resp = (logprobs.double() * mask).sum(-1) - mb["kl_ref_resp"][positions, epoch]
            sent = (sentence_sums(logprobs.double(), starts[positions], ends[positions])
                    - mb["kl_ref_sent"][positions, epoch])[sent_valid]
        else:
            diff = logprobs - self.actor.reference_logprobs(rollout)
            resp = (diff * mask).sum(-1).double()
            sent = sentence_sums(diff, starts[positions], ends[positions])[sent_valid].double()
        w = weight.double()
        sums = self.parallel.sum_tensor(torch.stack([(resp * w).sum(), w.sum(), sent.sum(), sent_valid.sum().double()]))
        z0 = max(float(sums[0] / sums[1]), 0.0) if sums[1] > 0 else 0.0  # reference_point over the global pairs
        return z0, max(float(sums[2] / sums[3]), 0.0) if sums[3] > 0 else 0.0

    # ------------------------------------------------------------------ the loop
    def train_iteration_batches(self, preempted: PreemptionFlag) -> bool:
        """Train on ``self.data`` from ``self.position``; returns False when stopped by a signal or max_steps."""
        m, k = self.cfg.model, self.cfg.kto
        n = self.data["tokens"].shape[0]
        per_epoch = math.ceil(n / m.global_batch_size)
        total = per_epoch * k.epochs_per_iteration
        while self.position < total:
            if self.step >= self.cfg.trainer.max_steps:
                return False
            started = time.perf_counter()
            epoch, index = divmod(self.position, per_epoch)
            idx = self._minibatch(n, epoch, index)
            # every rank holds the same data and draws the same global minibatch, then trains on its rows of it
            global_mb = {key: v[idx] for key, v in self.data.items()}
            positions, weight = rank_rows(len(idx), self.parallel.rank, self.parallel.size, m.micro_batch_size)
            mb = {key: v[positions] for key, v in global_mb.items() if not key.startswith("kl_ref_")}
            mb["weight"] = weight  # 0 on padding rows (rank_rows); 1 · a loss term is that term, exactly
            mb["sent_valid"] = mb["sent_valid"] & (weight > 0).unsqueeze(1)
            timer = PhaseTimer()
            with timer("reference_points"):
                z0, z0_f = self._reference_points(global_mb, positions, weight, epoch) if len(idx) > 1 else (0.0, 0.0)
            n_sent = float(global_mb["sent_valid"].sum())  # global counts: the global minibatch is on every rank
            fn = partial(self.loss_fn, z0=z0, z0_f=z0_f, n_examples=float(len(idx)), n_sentences=n_sent)
            with timer("train"):
                result = self.actor.train_step(mb, fn, micro_batch_size=m.micro_batch_size)
            # the backends average loss shares over micro batches and data-parallel ranks: sum them back
            n_micro = math.ceil(len(positions) / m.micro_batch_size) * self.parallel.size
            metrics = {key: v * (n_micro if key.startswith("loss/") else 1) for key, v in result.items()}
            metrics.update({"kto/z0": z0, "kto/z0_f": z0_f, "iteration": float(self.iteration), **timer.times})
            metrics.update(self._pending)
            metrics = self.parallel.reduce_metrics(metrics)  # the collect stats are global already; times are means
            self._pending = {}
            self.step += 1
            self.position += 1
            self.logger.log(self.step, metrics)
            log.info("step %d/%d (iteration %d/%d, minibatch %d/%d): loss/kto %.4f loss/fkto %.4f z0 %.4f; the "
                     "iteration's samples %.0f%% desirable (%.2f s)", self.step, self.cfg.trainer.max_steps,
                     self.iteration + 1, k.num_iterations, self.position, total, metrics.get("loss/kto", math.nan),
                     metrics.get("loss/fkto", math.nan), z0, 100 * self.desirable_frac, time.perf_counter() - started)
            stopping = self.parallel.any_rank(bool(preempted))  # the signal reaches the ranks at different moments
            # the iteration's last step is checkpointed by fit at the iteration's end (one checkpoint of that step)
            interval = self.cfg.trainer.save_interval and self.step % self.cfg.trainer.save_interval == 0
            if stopping or (interval and self.position < total):
                self._save()
            if stopping:
                preempted.signal = preempted.signal or "a signal to another rank"
                return False
        return True

    def fit(self) -> None:
        """``kto.num_iterations`` iterations, or fewer when ``trainer.max_steps`` optimiser steps come first (an
        iteration that would start at ``max_steps`` is not sampled); SIGUSR1 checkpoints and returns."""
        self._maybe_resume()
        k = self.cfg.kto
        reason = "kto.num_iterations"
        with PreemptionFlag() as preempted:
            while self.iteration < k.num_iterations:
                if self.step >= self.cfg.trainer.max_steps:  # before sampling: no judge calls for steps never taken
                    reason = "max_steps"
                    break
                if self.data is None:
                    self.actor.reset_reference()  # reference = this iteration's starting policy
                    timer = PhaseTimer()
                    try:
                        # the labeller's server gone past its retry window: checkpoint the iteration as not yet sampled
                        with timer("collect"), checkpoint_if_server_gone(self._save, step=self.step,
                                                                         start=StepStart(self.sampler)):
                            self.data, stats = self.collect()
                    except TrainingStalledError as err:  # nothing labelled, nothing to train on: checkpoint and stop
                        self.logger.close()
                        raise TrainingStalledError(f"{err}; checkpoint {self._save()} is written: fix the reward and "
                                                   "rerun the same command to resume") from None
                    self._pending = {**stats, **timer.times}  # logged with the iteration's first optimiser step
                    self.desirable_frac = stats["kto/desirable_frac"]
                    self.position = 0
                if not self.train_iteration_batches(preempted):
                    if preempted:
                        log.warning("stopped by %s at step %d; checkpoint written, rerun to resume", preempted.signal, self.step)
                        self.logger.close()
                        return
                    reason = "max_steps"
                    break
                self.last_data = self.data  # kept for inspection (tests, reports) after the iteration ends
                self.iteration, self.data = self.iteration + 1, None
                if self.validate is not None:
                    self.logger.log(self.step, self.parallel.reduce_metrics(dict(self.validate(self.step))))
                self._save()
        self._save()  # not written (nor logged) again when the iteration's end just wrote this step
        self.actor.export(self.run_dir / "final")
        log.info("training finished at step %d (%s); final policy in %s", self.step, reason, self.run_dir / "final")
        self.logger.close()

    def _state(self) -> dict[str, Any]:
        # pending: the collected iteration's statistics, not yet logged (with its first optimiser step): a run stopped
        # between collecting and that step logged them nowhere once resumed
        return {"step": self.step, "iteration": self.iteration, "position": self.position,
                "sampler": self.sampler.state_dict(), "has_data": self.data is not None, "pending": self._pending,
                "desirable_frac": self.desirable_frac}

    def _save(self) -> Path:
        return self.checkpointer.save(self.step, self.actor, None, self._state(), extra=self._save_data)

    def _save_data(self, path: Path) -> None:
        """The iteration's examples (gathered over data-parallel ranks: the same on every rank, written once)."""
        if self.data is not None:
            from safetensors.torch import save_file

            save_file({k: (v.to(torch.uint8) if v.dtype == torch.bool else v).contiguous() for k, v in self.data.items()},
                      path / "iteration_data.safetensors")

    def _maybe_resume(self) -> None:
        latest = self.checkpointer.latest() if self.cfg.exp_manager.resume_if_exists else None
        if latest is None:
            return
        state = self.checkpointer.load(latest, self.actor, None)
        self.step, self.iteration, self.position = state["step"], state["iteration"], state["position"]
        self._pending = state.get("pending", {})  # absent from checkpoints written before it was kept
        self.desirable_frac = state.get("desirable_frac", math.nan)
        self.sampler.load_state_dict(state["sampler"])
        if state["has_data"]:
            from safetensors.torch import load_file

            raw = load_file(latest / "iteration_data.safetensors")
            bools = ("desirable", "sent_label", "sent_valid")
            self.data = {k: (v.to(torch.bool) if k in bools else v) for k, v in raw.items()}
            if self.cfg.kto.precompute_reference and "kl_ref_resp" not in self.data:  # written without them
                self.data.update(self.iteration_references(self.data))
        self.logger.truncate_after(self.step)
        log.info("resumed from %s (iteration %d, step %d)", latest, self.iteration, self.step)


def _as_rollout(data: Mapping[str, torch.Tensor]) -> Rollout:
    return Rollout(data["tokens"], data["prompt_lengths"], data["response_lengths"],
                   torch.ones(data["tokens"].shape[0], dtype=torch.bool))


if __name__ == "__main__":  # `python -m nemo_factuality.trainers.kto`: `nemo-factuality train kto`, through the
    from nemo_factuality.cli import run_as_module  # commands' one boundary (it imports no stage: no circle)

    run_as_module("train", "kto")
