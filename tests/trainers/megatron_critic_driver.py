"""Runs in the megatron venv (``tools/setup_stack_env.sh megatron``), under torchrun on gloo: the megatron backend's critic
(``MegatronCritic``) against the hf backend's (``HFCritic``) on the same tiny HF checkpoint. Each command writes
``<out>/<tag>.rank<r>.json``.

    python tests/trainers/megatron_critic_driver.py make-models --out DIR
    torchrun --nproc_per_node 2 tests/trainers/megatron_critic_driver.py parity --hf DIR/hf --out DIR --tag tp2 --tp 2

* ``make-models``: ``DIR/hf``, the checkpoint of ``megatron_driver.py make-model``, and ``DIR/hf_tied``, the same with
  tied embeddings (``lm_head`` dropped): the same critic for transformers (a token-classification model has no
  ``lm_head``), a tied GPTModel for Megatron.
* ``parity``: the actor and critic built by the backend (``trainer.backend=megatron``, PPO) and ``HFCritic`` at world
  1 on the whole batch: values, then two SGD steps of the stage's clipped value loss (clipping off, so a gradient's
  scale shows in the update) — each step's loss and gradient norm, the values after each. The first step moves only
  the zero-initialised head (the backbone's gradient is 0 through a zero head), the second the backbone too. Data
  parallelism: each rank its contiguous rows, the loss normalised by the global token count. Then a second critic with
  AdamW (and the distributed optimizer with ``--distributed-optimizer``): step, save, step, load, step again (exactly
  equal); with ``--resume`` it first loads a checkpoint another layout saved after its first step.
* ``parity --bug NAME``: the same with a bug put in (the checks must then fail; run by hand, not in CI):
  ``tp-sharded-head`` marks the head TP-sharded (its gradient counted on every TP rank in the norm),
  ``summed-head-grad`` sums the head's gradient over the TP ranks, ``doubled-grad`` doubles every gradient,
  ``tied`` leaves the model tied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import megatron_cpu  # noqa: E402

megatron_cpu.apply()

import torch  # noqa: E402
from megatron_driver import as_rollout, fixed_batch, make_model  # noqa: E402  (the sibling driver; this directory is on sys.path)

from nemo_factuality.algorithms import value_loss  # noqa: E402
from nemo_factuality.trainers.config import PPOConfig, load_train_config  # noqa: E402

LR = 0.05  # SGD: the updates move the values by ~0.4 and ~0.8, against rounding differences of ~1e-6
CLIP = 10.0  # the value loss's clip: wide, so no term loses its gradient to it


def make_models(out: Path) -> None:
    make_model(out / "hf")
    make_tied(out / "hf", out / "hf_tied")


def make_tied(hf: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for item in hf.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, out / item.name)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = {k: v for k, v in load_file(str(hf / "model.safetensors")).items() if k != "lm_head.weight"}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def config(args, *extra: str) -> PPOConfig:
    return load_train_config(PPOConfig, None, [
        f"model.path={args.hf}", "trainer.backend=megatron", f"model.tensor_model_parallel_size={args.tp}",
        f"model.pipeline_model_parallel_size={args.pp}", "model.global_batch_size=8", "ppo.num_prompts_per_step=8",
        "critic.micro_batch_size=2", "remote_rm.url=http://127.0.0.1:9",
        f"model.megatron.sequence_parallel={args.sequence_parallel}", *extra])


def critic_batch() -> tuple[dict[str, torch.Tensor], float]:
    """The fixed 8 sequences with returns (N(0, 1) on the response tokens) and old values 0 (a zero head's)."""
    batch = fixed_batch()
    gen = torch.Generator().manual_seed(5)
    batch["returns"] = torch.randn(batch["mask"].shape, generator=gen) * batch["mask"]
    batch["old_values"] = torch.zeros_like(batch["mask"])
    return batch, float(batch["mask"].sum())


def value_loss_fn(global_tokens: float):
    def loss(out, mb):
        value = value_loss(out["values"], mb["old_values"], mb["returns"], mb["mask"], CLIP, global_tokens=global_tokens)
        return value, {"loss/value": float(value)}

    return loss


def hf_reference(args, cfg: PPOConfig) -> dict:
    """``HFCritic`` at world 1 on the whole batch (under torchrun it would sum its gradient over the job's ranks)."""
    from nemo_factuality.trainers.backends.hf.actor import HFCritic

    class WorldOneCritic(HFCritic):
        data_parallel_size = 1

    critic = WorldOneCritic(cfg.critic, cfg.model.path, max_steps=10, gradient_clip_val=0.0)
    batch, tokens = critic_batch()
    out = {"values0": critic.values(as_rollout(batch)).tolist()}
    for step in (1, 2):
        out[f"metrics{step}"] = critic.train_step(batch, value_loss_fn(tokens), micro_batch_size=2)
        out[f"values{step}"] = critic.values(as_rollout(batch)).tolist()
    return out


def put_bug(name: str, critic) -> None:
    """One of the bugs the parity checks must catch (module docstring), in the built critic."""
    from megatron.core import parallel_state

    head = critic.model.output_layer if critic.model.post_process else None
    if name == "tp-sharded-head" and head is not None:
        for p in head.parameters():
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
    elif name in ("summed-head-grad", "doubled-grad"):
        reduce = critic._reduce_gradients

        def buggy() -> float:
            params = list(head.parameters()) if name == "summed-head-grad" and head is not None else []
            if name == "doubled-grad":
                params = [p for p in critic.model.parameters()]
            for p in params:
                if name == "summed-head-grad":
                    torch.distributed.all_reduce(p.main_grad, group=parallel_state.get_tensor_model_parallel_group())
                else:
                    p.main_grad.mul_(2)
            return reduce()

        critic._reduce_gradients = buggy


def parity(args) -> dict:
    from nemo_factuality.trainers.backends import BACKENDS
    from nemo_factuality.trainers.backends.megatron import critic as megatron_critic
    from nemo_factuality.trainers.backends.megatron.critic import MegatronCritic

    if args.bug == "tied":  # the value head installed, the model left tied
        install = megatron_critic.install_value_head

        def still_tied(weight, bias):
            hook = install(weight, bias)

            def keep_tie(chunks):
                shared = [c.share_embeddings_and_output_weights for c in chunks]
                hook(chunks)
                for c, s in zip(chunks, shared, strict=True):
                    c.share_embeddings_and_output_weights = s
                return chunks

            return keep_tie

        megatron_critic.install_value_head = still_tied
    cfg = config(args, "critic.optim.name=sgd", f"critic.optim.lr={LR}", "trainer.gradient_clip_val=0")
    actor, critic = BACKENDS.get("megatron")(cfg, critic=True)
    assert isinstance(critic, MegatronCritic)
    if args.bug and args.bug != "tied":
        put_bug(args.bug, critic)
    batch, tokens = critic_batch()
    dp, rank = critic.data_parallel_size, critic.data_parallel_rank
    mine = {k: v[rank * 8 // dp : (rank + 1) * 8 // dp] for k, v in batch.items()}
    result: dict = {"dp": dp, "values0": critic.values(as_rollout(batch)).tolist()}
    for step in (1, 2):
        result[f"metrics{step}"] = critic.train_step(mine, value_loss_fn(tokens), micro_batch_size=2)
        result[f"values{step}"] = critic.values(as_rollout(batch)).tolist()
    head = critic.model.output_layer if critic.model.post_process else None
    result["head"] = None if head is None else [head.weight.detach().flatten().tolist(), head.bias.tolist()]
    result["embedding_is_the_head"] = bool(head is not None and critic.model.pre_process
                                           and head.weight.data_ptr() == critic.model.embedding.word_embeddings.weight.data_ptr())
    result["hf"] = hf_reference(args, cfg)
    result.update(checkpoints(args, cfg, MegatronCritic, mine, tokens, batch))
    return result


def checkpoints(args, cfg, critic_cls, mine, tokens, batch) -> dict:
    """An AdamW critic (its optimiser state is more than the weights): with ``--resume``, load another layout's
    checkpoint first; step, save, step, load, step again."""
    adam = config(args, "critic.optim.name=adamw", "critic.optim.lr=0.01", "trainer.gradient_clip_val=1.0",
                  f"model.megatron.use_distributed_optimizer={args.distributed_optimizer}")
    from nemo_factuality.trainers.backends.megatron import build

    critic = critic_cls(adam.critic, adam.model.path, tensor=args.tp, pipeline=args.pp, max_steps=10,
                        distributed_timeout_s=adam.trainer.distributed_timeout_s, gradient_clip_val=1.0,
                        seed=adam.trainer.seed, settings=build.Settings.of(adam.model))
    out: dict = {}
    values = lambda: critic.values(as_rollout(batch)).tolist()  # noqa: E731
    step = lambda: critic.train_step(mine, value_loss_fn(tokens), micro_batch_size=2)  # noqa: E731
    if args.resume:
        critic.load(Path(args.resume))
        out["resumed_values"] = values()
    out["adam_metrics1"], out["adam_values1"] = step(), values()
    ckpt = Path(args.out) / f"{args.tag}_ckpt"
    critic.save(ckpt)
    out["adam_files"] = sorted(p.name for p in ckpt.iterdir()) if critic.global_rank == 0 else []
    out["adam_metrics2"], out["adam_values2"] = step(), values()
    critic.load(ckpt)
    out["adam_loaded_values1"] = values()
    out["adam_metrics2_after_load"], out["adam_values2_after_load"] = step(), values()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["make-models", "parity"])
    ap.add_argument("--hf")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (TP > 1): the head gathers")
    ap.add_argument("--distributed-optimizer", action="store_true", help="the AdamW critic: Megatron's distributed optimizer")
    ap.add_argument("--resume", help="the AdamW critic: load this checkpoint (saved at another layout) first")
    ap.add_argument("--bug", choices=["tp-sharded-head", "summed-head-grad", "doubled-grad", "tied"])
    args = ap.parse_args()
    if args.command == "make-models":
        make_models(Path(args.out))
        return 0
    result = parity(args)
    rank = torch.distributed.get_rank()
    (Path(args.out) / f"{args.tag}.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
