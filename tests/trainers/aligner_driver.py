"""Runs in the NeMo-Aligner venv (python or torchrun, gloo): drives ``AlignerActor`` and writes what it saw.

    torchrun --nproc_per_node 2 tests/trainers/aligner_driver.py --nemo DIR --out DIR --tp 2 [--scenario core]

Each rank writes ``<out>/rank<r>.json``. Scenarios:

* ``core``: greedy rollouts for its data-parallel slice of PROMPTS, log-probs, reference log-probs,
  ``train_step`` × steps with the project's PPO/GRPO policy loss (global token count via
  ``all_reduce_sum``), log-probs and reference log-probs after, then ``reset_reference``.
* ``resume``: step, save, step → A; load the saved state, step again → B (B must equal A); export a ``.nemo``.
* ``sample``: sampled (not greedy) rollouts, twice with the same seed.
* ``stage`` / ``stage_dp``: the GRPO stage itself, 2 steps then a resumed 3rd (``stage_dp``: prompts
  sharded over data-parallel ranks).
* ``kto_dp``: the KTO stage at DP=2 (each rank labels its prompts; the examples are gathered; the reference
  log-probs once per iteration, split over the ranks); at world 1 also the per-step reference path.
* ``rollout``: rollout micro batches bucketed by prompt length, forward steps counted, early end on EOS.
* ``overlap``: the GRPO step with the reward overlapped vs in line, and KTO's labelling likewise (TP=2).
* ``ppo``: the RLFH PPO stage (``PPOTrainer``, dense toy reward) on this actor and the critic server the test
  started (``RemoteCritic``), 2 steps then a resumed 3rd; ``--overrides FILE`` holds the stage config's
  ``key=value`` list, the same the critic server was started with.
* ``methods``: every method's reward, served by ``nemo-factuality serve`` (``remote_rm.url``), through its stage on
  one actor, one stage after another: ``--plan FILE`` lists ``{name, stage, config, overrides}`` (KLCF, FSPO,
  KnowRL → GRPO; FactAlign → KTO; RLFH → PPO with the critic server). Records per stage what ``fit`` logged,
  what each reward call returned (the stage's own client) and what it wrote.
* ``ckpt_save``: train, save ``initial_ref`` (reference = the restored .nemo), ``reset_reference`` (KTO's case),
  train, save ``stored_ref``; each checkpoint's bytes and the log-probs / reference log-probs of fixed
  sequences at each save. ``ckpt_load --ckpt DIR``: load both (another layout), the same log-probs, one more step.
* ``outage``: the planned GRPO stages (``--plan``: ``undisturbed`` then ``restarted``), each from the same initial
  weights and seed, against a served reward; the test kills and restarts the server during the second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import aligner_cpu  # noqa: E402

aligner_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.algorithms.advantages import response_mask  # noqa: E402
from nemo_factuality.algorithms.losses import ppo_policy_loss  # noqa: E402
from nemo_factuality.trainers.backends.aligner.actor import AlignerActor, build_actor  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout, SamplingParams  # noqa: E402

PROMPTS = ["The Eiffel Tower is", "Marie Curie won", "Water boils at 100 degrees", "Albert Einstein was born in Ulm"]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
MAX_NEW = 6


def _actor(args) -> AlignerActor:
    """Built the way a stage builds it: the typed GRPO config (trainer.backend=aligner) → ``build_actor``."""
    overrides = [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "trainer.gradient_clip_val=10.0",
                 f"model.tensor_model_parallel_size={args.tp}", f"model.pipeline_model_parallel_size={args.pp}",
                 "model.micro_batch_size=1", f"model.global_batch_size={len(PROMPTS)}", "model.forward_micro_batch_size=2",
                 "model.dtype=float32", f"model.optim.name={args.optim}", f"model.optim.lr={args.lr}", "model.optim.weight_decay=0.0",
                 "model.optim.sched.name=constant", "remote_rm.url=http://127.0.0.1:5555"]  # (no reward is called here)
    cfg = load_train_config(GRPOConfig, None, overrides)
    model_overrides = dict(aligner_cpu.CPU_MODEL_OVERRIDES)
    if args.optim == "sgd":
        model_overrides["optim"] = {"momentum": args.momentum}
    return build_actor(cfg, max_steps=10, rollout_micro_batch_size=3, model_overrides=model_overrides)


def _my_prompts(actor: AlignerActor) -> tuple[list[list[int]], list[float], int]:
    per_rank = len(PROMPTS) // actor.data_parallel_size
    start = actor.data_parallel_rank * per_rank
    ids = [actor.tokenizer.encode(p) for p in PROMPTS[start:start + per_rank]]
    return ids, ADVANTAGES[start:start + per_rank], start


def _batch(actor: AlignerActor, rollout, advantages: list[float], old_logprobs: torch.Tensor) -> dict:
    mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, rollout.tokens.shape[1] - 1)
    global_tokens = actor.all_reduce_sum(mask.sum())
    adv = torch.tensor(advantages).unsqueeze(1).expand_as(mask).contiguous()
    return {"tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths, "response_lengths": rollout.response_lengths,
            "mask": mask, "advantages": adv, "old_logprobs": old_logprobs, "global_tokens": global_tokens}


def policy_loss(out, mb):
    return ppo_policy_loss(out["logprobs"], mb["old_logprobs"], mb["advantages"], mb["mask"],
                           global_tokens=float(mb["global_tokens"]))


def entropy_bonus_loss(out, mb):
    """Maximise the mean response-token entropy (exercises ``need_entropy``: vocab gathered over TP)."""
    mean_entropy = (out["entropy"] * mb["mask"]).sum() / float(mb["global_tokens"])
    return -mean_entropy, {"entropy": float(mean_entropy.detach())}


def _rows(t: torch.Tensor) -> list:
    return t.tolist()


def core(actor: AlignerActor, args) -> dict:
    prompts, advantages, start = _my_prompts(actor)
    t0 = time.monotonic()
    rollout = actor.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, use_greedy=True))
    gen_s = time.monotonic() - t0
    lp0, ref0 = actor.logprobs(rollout), actor.reference_logprobs(rollout)
    batch = _batch(actor, rollout, advantages, lp0)
    metrics = [actor.train_step(batch, policy_loss, micro_batch_size=1) for _ in range(args.steps)]
    lp1, ref1 = actor.logprobs(rollout), actor.reference_logprobs(rollout)
    actor.reset_reference()
    ref2 = actor.reference_logprobs(rollout)
    entropy = actor.train_step(batch, entropy_bonus_loss, micro_batch_size=1, need_entropy=True)
    return {"entropy_step": entropy, "start": start, "prompts": prompts, "tokens": _rows(rollout.tokens), "prompt_lengths": _rows(rollout.prompt_lengths),
            "response_lengths": _rows(rollout.response_lengths), "is_end": _rows(rollout.is_end),
            "lp0": _rows(lp0), "ref0": _rows(ref0), "lp1": _rows(lp1), "ref1": _rows(ref1), "ref2": _rows(ref2),
            "metrics": metrics, "generate_s": gen_s, "pad_id": actor.pad_id, "eos_id": actor.eos_id}


def resume(actor: AlignerActor, args) -> dict:
    prompts, advantages, start = _my_prompts(actor)
    rollout = actor.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, use_greedy=True))
    batch = _batch(actor, rollout, advantages, actor.logprobs(rollout))
    actor.train_step(batch, policy_loss, micro_batch_size=1)
    ckpt = Path(args.out) / "ckpt"
    actor.save(ckpt)
    m_a = actor.train_step(batch, policy_loss, micro_batch_size=1)
    lp_a = actor.logprobs(rollout)
    actor.load(ckpt)
    m_b = actor.train_step(batch, policy_loss, micro_batch_size=1)
    lp_b = actor.logprobs(rollout)
    actor.export(Path(args.out) / "trained.nemo")
    return {"start": start, "tokens": _rows(rollout.tokens), "prompt_lengths": _rows(rollout.prompt_lengths),
            "response_lengths": _rows(rollout.response_lengths), "lp_a": _rows(lp_a), "lp_b": _rows(lp_b),
            "metrics_a": m_a, "metrics_b": m_b}


def sample(actor: AlignerActor, args) -> dict:
    prompts, _, start = _my_prompts(actor)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=0, top_p=1.0)
    runs = []
    for _ in range(2):
        torch.manual_seed(args.seed)
        r = actor.generate(prompts * 2, params)
        runs.append({"tokens": _rows(r.tokens), "response_lengths": _rows(r.response_lengths),
                     "prompt_lengths": _rows(r.prompt_lengths), "is_end": _rows(r.is_end)})
    return {"start": start, "runs": runs}


def stage(actor: AlignerActor, args) -> dict:
    """The project's GRPO stage (``GRPOTrainer``) on this actor with the toy scalar reward passed in
    (remote_rm.url only satisfies the schema; nothing is served), then a resume."""
    from nemo_factuality.testing.training import good_fraction, prompts, read_metrics
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.runtime import seed_everything

    # SGD without momentum: the weights are the whole training state (extra states such as TE fp8 may be None)
    initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in actor.model.state_dict().items()}
    run_dir = Path(args.out) / "run"
    seed_everything(args.seed)
    cfg = load_train_config(GRPOConfig, None, _stage_overrides(args, run_dir, max_steps=2))
    GRPOTrainer(cfg, actor, good_fraction, prompts(4), run_dir=run_dir).fit()
    first = read_metrics(run_dir)
    cfg = load_train_config(GRPOConfig, None, _stage_overrides(args, run_dir, max_steps=3))
    GRPOTrainer(cfg, actor, good_fraction, prompts(4), run_dir=run_dir).fit()  # resumes from step 2
    # the same 3 steps uninterrupted, from the same weights and seed
    actor.model.load_state_dict(initial)
    seed_everything(args.seed)
    full_dir = Path(args.out) / "uninterrupted"
    cfg = load_train_config(GRPOConfig, None, _stage_overrides(args, full_dir, max_steps=3))
    GRPOTrainer(cfg, actor, good_fraction, prompts(4), run_dir=full_dir).fit()
    return {"metrics": read_metrics(run_dir), "uninterrupted": read_metrics(full_dir), "first_run_steps": len(first),
            "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()) if (run_dir / "checkpoints").is_dir() else [],
            "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.iterdir())}


def stage_dp(actor: AlignerActor, args) -> dict:
    """``GRPOTrainer`` under data parallelism (torchrun, TP=1: DP = world size): 4 prompts per step sharded
    over the ranks, 2 steps, then a rerun to 3 that resumes. Records, per rank: its prompt indices per
    step, the metrics its ``fit`` returned, and after training a weight checksum and the log-probs of fixed
    sequences (data-parallel replicas must hold the same policy)."""
    from nemo_factuality.testing.training import good_fraction, prompts, read_metrics
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.runtime import _jsonable

    run_dir = Path(args.out) / "run"
    shards: list[list[int]] = []
    history: list[dict] = []
    seeds: list[int] = []

    def fit(max_steps: int) -> None:
        overrides = _stage_overrides(args, run_dir, max_steps=max_steps, prompts_per_step=4, global_batch_size=16)
        trainer = GRPOTrainer(load_train_config(GRPOConfig, None, overrides), actor, good_fraction, prompts(8), run_dir=run_dir)
        step = trainer.train_one_step

        def recording_step() -> dict:
            metrics = step()
            shards.append(list(trainer.step_prompts))
            return metrics

        trainer.train_one_step = recording_step
        seeds.append(trainer.cfg.trainer.seed)
        start = len(history)  # the rerun resumes where the first run's history ends
        for i, m in enumerate(trainer.fit()):
            history.append({"step": start + i + 1, **{k: _jsonable(v) for k, v in m.items()}})

    fit(2)
    first_run_lines = len(read_metrics(run_dir))
    fit(3)  # resumes from step 2's checkpoint
    validation = _split_validation(actor, args)
    ckpt = run_dir / "checkpoints"
    fixed = [actor.tokenizer.encode(p) for p in PROMPTS[:2]]
    width = max(len(x) for x in fixed)
    rollout = Rollout(torch.tensor([x + [actor.pad_id] * (width - len(x)) for x in fixed]), torch.tensor([1, 1]),
                      torch.tensor([len(x) for x in fixed]), torch.ones(2, dtype=torch.bool))
    return {"shards": shards, "history": history, "first_run_lines": first_run_lines, "metrics": read_metrics(run_dir),
            "checkpoints": sorted(p.name for p in ckpt.iterdir()),
            "step3_files": sorted(p.name for p in (ckpt / "step_000003").iterdir()),
            "weight_sum": float(sum(p.detach().double().sum() for p in actor.model.parameters())),
            "fixed_logprobs": _rows(actor.logprobs(rollout)), "seed": seeds[0], "validation": validation}


def _split_validation(actor: AlignerActor, args) -> dict:
    """The GRPO stage's validation of 5 prompts under data parallelism (each rank its part: 2 + 3), and the old
    way on this rank (every prompt generated here and scored together) for comparison."""
    from nemo_factuality.testing.training import good_fraction, prompts
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.interfaces import SamplingParams as Sampling
    from nemo_factuality.trainers.runtime import encode_prompts, score_rollout

    seen: list[str] = []

    def reward(prompts_, completions, **columns):
        seen.extend(prompts_)
        return good_fraction(prompts_, completions, **columns)

    run_dir = Path(args.out) / "val"
    cfg = load_train_config(GRPOConfig, None, _stage_overrides(args, run_dir, max_steps=1, prompts_per_step=4,
                                                               global_batch_size=16))
    val = prompts(5)
    trainer = GRPOTrainer(cfg, actor, reward, prompts(8), run_dir=run_dir, val_data=val)
    split = trainer._validate_reward(0)
    mine = list(seen)
    ids = encode_prompts(val, actor.tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_tokens)
    every = actor.generate(ids, Sampling(cfg.model.length_params.max_length, use_greedy=True))
    whole = score_rollout(good_fraction, every, val, actor.tokenizer, actor.eos_id)[0].log_dict("reward")
    return {"split": split, "scored_here": mine, "whole": whole}


def kto_dp(actor: AlignerActor, args) -> dict:
    """``KTOTrainer`` under data parallelism: 4 prompts × 2 samples per iteration, each rank samples and labels
    its 2 prompts (the toy labeller leaves one sample unlabelled, so the ranks label 4 and 3), the examples
    are gathered and each minibatch of 4 is split over the ranks (the 3-row one padded). Greedy sampling
    (KTO needs no diversity), so world 1 collects the same examples and must train to the same policy.
    Records per rank: the prompts it labelled, every metrics dict it logged, the gathered data, a weight
    checksum and the trained policy's log-probs of the data."""
    from nemo_factuality.testing.training import half_good_labeller, prompts, read_metrics
    from nemo_factuality.trainers.config import KTOConfig
    from nemo_factuality.trainers.kto import KTOTrainer
    from nemo_factuality.trainers.runtime import _jsonable

    run_dir = Path(args.out) / "kto"
    overrides = [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "trainer.max_steps=10",
                 "trainer.save_interval=0", "trainer.progress_bar=false", "kto.num_iterations=1",
                 "kto.prompts_per_iteration=4", "kto.samples_per_prompt=2", "kto.epochs_per_iteration=1",
                 "model.micro_batch_size=1", "model.global_batch_size=4", "model.forward_micro_batch_size=4",
                 "model.length_params.max_length=6", "model.dtype=float32", "model.optim.name=sgd", "model.optim.lr=0.05",
                 "model.sampling_params.use_greedy=true", "remote_rm.url=http://127.0.0.1:5555",
                 f"exp_manager.explicit_log_dir={run_dir}",
                 "exp_manager.create_tensorboard_logger=false"]
    labelled: list[str] = []
    logged: list[dict] = []

    def labeller(prompts_, completions, **kw):
        labelled.extend(prompts_)
        return half_good_labeller(prompts_, completions, **kw)

    initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in actor.model.state_dict().items()}
    reference = actor.reference_logprobs
    rows_referenced: list[int] = []  # the rows of each reference_logprobs call on this rank

    def counted(rollout):
        rows_referenced.append(len(rollout))
        return reference(rollout)

    actor.reference_logprobs = counted
    trainer = KTOTrainer(load_train_config(KTOConfig, None, overrides), actor, labeller, prompts(4), run_dir=run_dir)
    log_step = trainer.logger.log
    trainer.logger.log = lambda step, m: (logged.append({"step": step, **{k: _jsonable(v) for k, v in m.items()}}),
                                          log_step(step, m))[-1]
    trainer.fit()
    data = trainer.last_data
    out = {"labelled": labelled, "logged": logged, "metrics": read_metrics(run_dir), "seed": trainer.cfg.trainer.seed,
           "data_tokens": _rows(data["tokens"]), "desirable": _rows(data["desirable"]),
           "prompt_lengths": _rows(data["prompt_lengths"]), "response_lengths": _rows(data["response_lengths"]),
           "lp": _rows(actor.logprobs(Rollout(data["tokens"], data["prompt_lengths"], data["response_lengths"],
                                              torch.ones(len(data["tokens"]), dtype=torch.bool)))),
           "weight_sum": float(sum(p.detach().double().sum() for p in actor.model.parameters())),
           "reference_rows": list(rows_referenced)}
    if actor.data_parallel_size == 1:  # the per-step reference path, from the same weights and seed
        actor.model.load_state_dict(initial)
        old_dir = Path(args.out) / "kto_old"
        old = [o for o in overrides if not o.startswith("exp_manager.explicit_log_dir=")]
        trainer = KTOTrainer(load_train_config(KTOConfig, None, [*old, f"exp_manager.explicit_log_dir={old_dir}",
                                                                 "kto.precompute_reference=false"]),
                             actor, half_good_labeller, prompts(4), run_dir=old_dir)
        rows_referenced.clear()
        trainer.fit()
        out.update(old_metrics=read_metrics(old_dir), old_reference_rows=list(rows_referenced))
    return out


def rollout(actor: AlignerActor, args) -> dict:
    """Rollout micro batches (world 1, ``rollout_micro_batch_size=3``): greedy rollouts of PROMPTS × 2 in the given
    order and reversed, with the number of model forward steps each ``generate`` took; then the same after making
    the model end every response at once (the residual stream reduced to the token embedding, whose dimension 0
    points every next-token prediction at EOS), to see each batch stop when all its sequences have ended."""
    model = actor.model.model[0] if isinstance(actor.model.model, list) else actor.model.model
    steps = {"n": 0}
    model.register_forward_pre_hook(lambda *_: steps.__setitem__("n", steps["n"] + 1))
    prompts = [actor.tokenizer.encode(p) for p in PROMPTS * 2]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, use_greedy=True)

    def run(rows):
        steps["n"] = 0
        r = actor.generate(rows, greedy)
        return {"tokens": _rows(r.tokens), "response_lengths": _rows(r.response_lengths), "is_end": _rows(r.is_end),
                "steps": steps["n"]}

    out = {"prompt_lengths": [len(p) for p in prompts], "rollout_micro_batch_size": actor.runtime.rollout_micro_batch_size,
           "max_new": MAX_NEW, "eos_id": actor.eos_id, "given": run(prompts), "reversed": run(prompts[::-1])}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "linear_proj" in name or "linear_fc2" in name:
                param.zero_()  # attention and MLP add nothing: the residual stream is the token embedding
        embedding = model.embedding.word_embeddings.weight
        embedding[:, 0] = 10.0
        embedding[actor.eos_id, 0] = 20.0  # tied output: EOS's logit is twice any other's
        output = getattr(model, "output_layer", None)
        if output is not None and output.weight is not embedding and not actor.model.cfg.get("share_embeddings_and_output_weights"):
            output.weight[:, 0] = 0.0
            output.weight[actor.eos_id, 0] = 10.0
    out["eos_model"] = run(prompts)
    return out


def overlap(actor: AlignerActor, args) -> dict:
    """At TP=2: the GRPO stage's overlapped step against the sequential one (2 steps each, from the same weights
    and seed), and the KTO stage's overlapped labelling against the in-line one, on a reward with a judge's
    latency. Records per mode the rewards, advantages and metrics of every step, the trained weights' checksum
    and which rank/thread called the reward."""
    import threading

    import nemo_factuality.trainers.kto as kto_module
    from nemo_factuality.testing.training import good_fraction, half_good_labeller, prompts
    from nemo_factuality.trainers.config import KTOConfig
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.kto import KTOTrainer
    from nemo_factuality.trainers.runtime import seed_everything

    initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in actor.model.state_dict().items()}

    def slow(reward, calls):
        def call(prompts_, completions, **columns):
            calls.append([threading.current_thread().name, len(completions)])
            time.sleep(0.2)
            return reward(prompts_, completions, **columns)
        return call

    class Recording(GRPOTrainer):
        def _experience(self, rollout, rewards, logprobs):
            exp, metrics = super()._experience(rollout, rewards, logprobs)
            self.seen.append({"scores": [None if x != x else x for x in rewards.scores.tolist()],
                              "advantages": _rows(exp["advantages"]), "tokens": _rows(rollout.tokens)})
            return exp, metrics

    out = {}
    for mode in (False, True):
        actor.model.load_state_dict(initial)
        actor.reset_reference()
        seed_everything(args.seed)
        calls: list = []
        run_dir = Path(args.out) / f"grpo_{mode}"
        cfg = load_train_config(GRPOConfig, None, _stage_overrides(args, run_dir, max_steps=2) + [f"grpo.overlap_reward={mode}"])
        trainer = Recording(cfg, actor, slow(good_fraction, calls), prompts(4), run_dir=run_dir)
        trainer.seen = []
        metrics = [{k: v for k, v in trainer.train_one_step().items()} for _ in range(2)]
        out[f"grpo_{mode}"] = {"seen": trainer.seen, "metrics": metrics, "calls": calls,
                               "weight_sum": float(sum(p.detach().double().sum() for p in actor.model.parameters()))}
    kto_module._GEN_CHUNK = 4  # two labeller calls for the 8 samples
    for mode in (False, True):
        actor.model.load_state_dict(initial)
        actor.reset_reference()
        seed_everything(args.seed)
        calls = []
        overrides = [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "kto.prompts_per_iteration=4",
                     "kto.samples_per_prompt=2", "model.micro_batch_size=1", "model.global_batch_size=4",
                     "model.length_params.max_length=6", "model.dtype=float32", "remote_rm.url=http://127.0.0.1:5555",
                     f"exp_manager.explicit_log_dir={Path(args.out) / f'kto_{mode}'}", f"kto.overlap_reward={mode}",
                     "exp_manager.create_tensorboard_logger=false", "trainer.progress_bar=false"]
        trainer = KTOTrainer(load_train_config(KTOConfig, None, overrides), actor, slow(half_good_labeller, calls),
                             prompts(4), run_dir=Path(args.out) / f"kto_{mode}")
        actor.reset_reference()
        data, stats = trainer.collect()
        out[f"kto_{mode}"] = {"data": {k: _rows(v) for k, v in data.items()}, "calls": calls,
                              "stats": {k: v for k, v in stats.items() if not k.startswith("time/")},
                              "times": {k: v for k, v in stats.items() if k.startswith("time/")}}
    return out


def learn(actor: AlignerActor, args) -> dict:
    """The training-stages issue's learning check on this backend: GRPO, the toy reward, 20 steps."""
    from nemo_factuality.testing.training import good_fraction, prompts, read_metrics
    from nemo_factuality.trainers.grpo import GRPOTrainer

    run_dir = Path(args.out) / "learn"
    torch.manual_seed(args.seed)
    cfg = load_train_config(GRPOConfig, None, _learn_overrides(args, run_dir))
    GRPOTrainer(cfg, actor, good_fraction, prompts(8), run_dir=run_dir).fit()
    return {"metrics": read_metrics(run_dir)}


def ppo(actor: AlignerActor, args) -> dict:
    """RLFH PPO for 2 steps, then a rerun to 3 that resumes (the critic server must be at the saved step); records
    what each critic_train request held so the test can recompute Aligner's value loss."""
    from nemo_factuality.testing.training import good_tokens_dense, prompts, read_metrics
    from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic, RemoteCriticError
    from nemo_factuality.trainers.config import PPOConfig
    from nemo_factuality.trainers.ppo import PPOTrainer

    calls: list[dict] = []

    def run(max_steps: int) -> RemoteCritic:
        cfg = load_train_config(PPOConfig, None, _ppo_overrides(args) + [f"trainer.max_steps={max_steps}"])
        critic = RemoteCritic(cfg.critic)
        send = critic.train_step

        def recording(batch, loss_fn, *, micro_batch_size):
            out = send(batch, loss_fn, micro_batch_size=micro_batch_size)
            mask = batch["mask"].double()
            # Aligner's loss when every value is 0 (a zero value head) is 0.5·Σ mask·R² / Σ mask over the minibatch
            # of all data-parallel ranks: this rank's two sums
            calls.append({"server_loss": out["critic/server_loss"], "old_values_absmax": float(batch["old_values"].abs().max()),
                          "sum_mask_r2": float((mask * batch["returns"].double() ** 2).sum()), "sum_mask": float(mask.sum())})
            return out

        critic.train_step = recording
        PPOTrainer(cfg, actor, critic, good_tokens_dense, prompts(4), run_dir=Path(cfg.exp_manager.explicit_log_dir)).fit()
        return critic

    run(2)
    critic = run(3)
    run_dir = Path(_ppo_config(args).exp_manager.explicit_log_dir)
    try:  # a checkpoint saved when the server was at another step must not resume silently
        critic.load(run_dir / "checkpoints" / "step_000002")  # saved with the server at step 2; it is at 3
        stale = None
    except RemoteCriticError as err:
        stale = str(err)
    probe = actor.generate([actor.tokenizer.encode(p) for p in PROMPTS], SamplingParams(max_new_tokens=MAX_NEW, use_greedy=True))
    return {"metrics": read_metrics(run_dir), "critic_calls": calls, "stale_error": stale,
            "server_step": critic.server_step(), "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
            "probe": {"tokens": _rows(probe.tokens), "prompt_lengths": _rows(probe.prompt_lengths),
                      "response_lengths": _rows(probe.response_lengths), "values": _rows(critic.values(probe))}}


class _RecordingReward:
    """The stage's reward client, recording what each call returned (scores, components, token outputs)."""

    def __init__(self, reward) -> None:
        self.reward, self.calls = reward, []

    def __call__(self, prompts, completions, **columns):
        import numpy as np

        batch = self.reward(prompts, completions, **columns)
        as_list = lambda a: [None if np.isnan(x) else float(x) for x in np.asarray(a, dtype=float)]  # noqa: E731
        self.calls.append({"n": len(batch), "scores": as_list(batch.scores), "prompts": list(prompts),
                           "components": {k: as_list(v) for k, v in batch.components.items()},
                           "n_ids": [len(x) for x in columns["completion_ids"]],
                           "token_rewards": None if batch.token_rewards is None else [as_list(t) for t in batch.token_rewards],
                           "token_signs": None if batch.token_signs is None else [as_list(t) for t in batch.token_signs],
                           "sentence_labels": batch.sentence_labels})
        return batch

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if callable(close):
            close()


def _method_stage(actor: AlignerActor, step: dict) -> dict:
    """One method's stage as ``trainers.cli.run_stage`` runs it (typed config, data, served reward), on this actor."""
    from nemo_factuality.testing.training import read_metrics
    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.data import load_pairs, load_prompts
    from nemo_factuality.trainers.runtime import _jsonable, build_reward

    stage = step["stage"]
    schema = {"grpo": schemas.GRPOConfig, "kto": schemas.KTOConfig, "ppo": schemas.PPOConfig}[stage]
    cfg = load_train_config(schema, step["config"], step["overrides"])
    run_dir = Path(cfg.exp_manager.explicit_log_dir)
    data = load_prompts(cfg.data.train, cfg.data.format)
    reward = _RecordingReward(build_reward(cfg, actor.tokenizer))
    out: dict = {"logged": []}
    t0 = time.monotonic()
    try:
        if stage == "grpo":
            from nemo_factuality.trainers.grpo import GRPOTrainer

            trainer = GRPOTrainer(cfg, actor, reward, data, run_dir=run_dir)
        elif stage == "kto":
            from nemo_factuality.trainers.kto import KTOTrainer

            pairs = load_pairs(cfg.data.general_pairs) if cfg.data.general_pairs else []
            trainer = KTOTrainer(cfg, actor, reward, data, general_pairs=pairs, run_dir=run_dir)
        else:
            from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic
            from nemo_factuality.trainers.ppo import PPOTrainer

            critic = RemoteCritic(cfg.critic)
            out["server_step_before"] = critic.server_step()
            trainer = PPOTrainer(cfg, actor, critic, reward, data, run_dir=run_dir)
        log_step = trainer.logger.log  # every rank's metrics (only the writer rank writes metrics.jsonl)
        trainer.logger.log = lambda n, m: (out["logged"].append({"step": n, **{k: _jsonable(v) for k, v in m.items()}}),
                                           log_step(n, m))[-1]
        trainer.fit()
        if stage == "ppo":
            out["server_step_after"] = critic.server_step()
            critic.close()
    finally:
        reward.close()
    ckpt = run_dir / "checkpoints"
    return {**out, "wall_s": time.monotonic() - t0, "metrics": read_metrics(run_dir), "calls": reward.calls,
            "checkpoints": sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else [],
            "final": (run_dir / "final").exists()}


def methods(actor: AlignerActor, args) -> dict:
    """Each planned method's stage in turn on this one actor (``--plan``), each in its own run directory."""
    return {"stages": {step["name"]: _method_stage(actor, step) for step in json.loads(Path(args.plan).read_text())}}


def _fixed_rollout(actor: AlignerActor) -> Rollout:
    """Every prompt + 3 fixed tokens, the same on every rank and layout (what log-probs are compared on)."""
    rows = [actor.tokenizer.encode(p) + [11, 12, 13] for p in PROMPTS]
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), actor.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return Rollout(tokens, torch.tensor([len(r) - 3 for r in rows]), torch.tensor([len(r) for r in rows]),
                   torch.ones(len(rows), dtype=torch.bool))


def _probe(actor: AlignerActor) -> dict:
    fixed = _fixed_rollout(actor)
    return {"lp": _rows(actor.logprobs(fixed)), "ref": _rows(actor.reference_logprobs(fixed)),
            "prompt_lengths": _rows(fixed.prompt_lengths), "response_lengths": _rows(fixed.response_lengths)}


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def ckpt_save(actor: AlignerActor, args) -> dict:
    prompts, advantages, _ = _my_prompts(actor)
    rollout = actor.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, use_greedy=True))
    batch = _batch(actor, rollout, advantages, actor.logprobs(rollout))
    out, result = Path(args.out), {}
    actor.train_step(batch, policy_loss, micro_batch_size=1)
    actor.save(out / "initial_ref")  # GRPO/PPO: the reference is the restored .nemo
    result["initial_ref"] = _probe(actor)
    actor.reset_reference()  # KTO: the reference is the iteration's starting policy
    actor.train_step(batch, policy_loss, micro_batch_size=1)
    actor.save(out / "stored_ref")
    result["stored_ref"] = _probe(actor)
    torch.distributed.barrier()
    for name in ("initial_ref", "stored_ref"):
        result[name]["bytes"] = _bytes(out / name)
        result[name]["files"] = sorted(str(f.relative_to(out / name)) for f in (out / name).iterdir())
    return result


def ckpt_load(actor: AlignerActor, args) -> dict:
    from nemo_factuality.types import FactualityInputError

    result = {}
    for name in ("initial_ref", "stored_ref"):
        actor.load(Path(args.ckpt) / name)
        result[name] = _probe(actor)
        prompts, advantages, _ = _my_prompts(actor)
        rollout = actor.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, use_greedy=True))
        result[name]["step"] = actor.train_step(_batch(actor, rollout, advantages, actor.logprobs(rollout)), policy_loss,
                                                micro_batch_size=1)
    try:  # the stored reference is loaded; asking for the initial one now needs a fresh process, said in one line
        actor.load(Path(args.ckpt) / "initial_ref")
    except FactualityInputError as err:
        result["refused"] = str(err)
    return result


def outage(actor: AlignerActor, args) -> dict:
    """Each planned stage from the same initial weights (SGD without momentum: the weights are the whole training
    state) and seed; the test disturbs the reward server while the later ones run."""
    from nemo_factuality.trainers.runtime import seed_everything

    initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in actor.model.state_dict().items()}
    runs = {}
    for step in json.loads(Path(args.plan).read_text()):
        actor.model.load_state_dict(initial)
        seed_everything(args.seed)
        runs[step["name"]] = _method_stage(actor, step)
    return {"stages": runs}


def _ppo_overrides(args) -> list[str]:
    import json

    return json.loads(Path(args.overrides).read_text())


def _ppo_config(args):
    from nemo_factuality.trainers.config import PPOConfig

    return load_train_config(PPOConfig, None, _ppo_overrides(args))


def _learn_overrides(args, run_dir: Path) -> list[str]:
    """The hf backend's learning-check settings (tests/trainers/test_grpo.py: grpo_cfg)."""
    return [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "trainer.max_steps=20",
            "trainer.save_interval=0", "trainer.progress_bar=false", "grpo.num_prompts_per_step=4",
            "grpo.num_rollouts_per_prompt=8", "grpo.truncated=keep", "model.micro_batch_size=8",
            "model.global_batch_size=16", "model.forward_micro_batch_size=16", "model.length_params.max_length=6",
            "model.dtype=float32", f"model.optim.name={args.optim}", f"model.optim.lr={args.lr}", "remote_rm.url=http://127.0.0.1:5555",
            f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false"]


def _stage_overrides(args, run_dir: Path, *, max_steps: int, prompts_per_step: int = 2, global_batch_size: int = 8) -> list[str]:
    return [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", f"trainer.max_steps={max_steps}",
            "trainer.save_interval=1", "trainer.progress_bar=false", f"grpo.num_prompts_per_step={prompts_per_step}",
            "grpo.num_rollouts_per_prompt=4", "grpo.truncated=keep", "model.micro_batch_size=4",
            f"model.global_batch_size={global_batch_size}",
            "model.forward_micro_batch_size=4", "model.length_params.max_length=6", "model.dtype=float32",
            "model.optim.name=sgd", "model.optim.lr=0.05", "remote_rm.url=http://127.0.0.1:5555", f"exp_manager.explicit_log_dir={run_dir}",
            "exp_manager.create_tensorboard_logger=false"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")  # the learn scenario's optimiser
    ap.add_argument("--overrides", default=None, help="JSON list of stage-config key=value (the ppo scenario)")
    ap.add_argument("--plan", default=None, help="JSON list of the methods scenario's stages")
    ap.add_argument("--ckpt", default=None, help="the ckpt_load scenario's checkpoints (ckpt_save's --out)")
    ap.add_argument("--scenario", choices=("core", "resume", "sample", "stage", "stage_dp", "kto_dp", "learn",
                                           "ppo", "methods", "outage", "ckpt_save", "ckpt_load", "rollout", "overlap"),
                    default="core")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.scenario == "learn":  # the stage's own settings (AdamW), as the hf backend's learning check
        cfg = load_train_config(GRPOConfig, None, _learn_overrides(args, Path(args.out) / "learn"))
        actor = build_actor(cfg, max_steps=100, rollout_micro_batch_size=32,
                            model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    elif args.scenario == "ppo":  # the actor the PPO stage config describes
        actor = build_actor(_ppo_config(args), max_steps=100, rollout_micro_batch_size=4,
                            model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    else:
        actor = _actor(args)
    setup_s = time.monotonic() - t0
    scenarios = {"core": core, "resume": resume, "sample": sample, "stage": stage, "stage_dp": stage_dp, "kto_dp": kto_dp,
                 "learn": learn, "ppo": ppo, "methods": methods, "outage": outage,
                 "ckpt_save": ckpt_save, "ckpt_load": ckpt_load, "rollout": rollout, "overlap": overlap}
    result = scenarios[args.scenario](actor, args)
    result.update(setup_s=setup_s, total_s=time.monotonic() - t0, dp_rank=actor.data_parallel_rank,
                  dp_size=actor.data_parallel_size, rank=torch.distributed.get_rank())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
