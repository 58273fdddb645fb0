"""One optimiser step of the hf backend's actor and critic on a fixed batch of 8 sequences, at the data-parallel size
torchrun gives (rank r trains on its contiguous 8/dp rows, the losses normalised by the global token count, as the
stages do). Global rank 0 writes ``<out>/dp<size>.pt``: the weights after the step and the reported metrics.

    python tests/trainers/hf_data_parallel_driver.py --hf DIR --out DIR
    torchrun --nproc_per_node 2 tests/trainers/hf_data_parallel_driver.py --hf DIR --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from nemo_factuality.trainers.backends.collectives import init_from_environment  # noqa: E402
from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic  # noqa: E402
from nemo_factuality.trainers.config import PPOConfig, load_train_config  # noqa: E402

ROWS, WIDTH = 8, 9


def fixed_batch() -> dict[str, torch.Tensor]:
    """8 sequences of 9 tokens (prompt 3), response lengths 5..9, a loss mask over each response."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(5, 390, (ROWS, WIDTH), generator=gen)
    lengths = torch.tensor([5, 9, 7, 6, 9, 8, 5, 7])
    pos = torch.arange(WIDTH - 1).unsqueeze(0)
    mask = ((pos >= 2) & (pos < lengths.unsqueeze(1) - 1)).float()
    return {"tokens": tokens, "prompt_lengths": torch.full((ROWS,), 3), "response_lengths": lengths, "mask": mask,
            "returns": torch.randn(ROWS, WIDTH - 1, generator=gen)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = init_from_environment("cpu", 60.0)
    cfg = load_train_config(PPOConfig, None, [f"model.path={args.hf}", "model.optim.name=sgd", "model.optim.lr=0.5",
                                              "critic.optim.name=sgd", "critic.optim.lr=0.5",
                                              "model.optim.sched.name=constant", "critic.optim.sched.name=constant",
                                              "model.global_batch_size=8", "remote_rm.url=http://127.0.0.1:9"])
    actor = HFActor(cfg.model, max_steps=1, gradient_clip_val=0.0, device=device)
    critic = HFCritic(cfg.critic, args.hf, max_steps=1, gradient_clip_val=0.0, device=device)
    batch = fixed_batch()
    global_tokens = float(batch["mask"].sum())
    dp, rank = actor.data_parallel_size, actor.data_parallel_rank
    mine = {k: v[rank * ROWS // dp : (rank + 1) * ROWS // dp] for k, v in batch.items()}

    def policy_loss(out, mb):
        loss = -(out["logprobs"] * mb["mask"]).sum() / global_tokens
        return loss, {"loss/policy": float(loss)}

    def value_loss(out, mb):
        loss = (((out["values"] - mb["returns"]) ** 2) * mb["mask"]).sum() / global_tokens
        return loss, {"loss/value": float(loss)}

    actor_metrics = actor.train_step(mine, policy_loss, micro_batch_size=2)
    critic_metrics = critic.train_step(mine, value_loss, micro_batch_size=2)
    if actor.global_rank == 0:
        torch.save({"actor": {k: v.detach().clone() for k, v in actor.model.state_dict().items()},
                    "critic": {k: v.detach().clone() for k, v in critic.model.state_dict().items()},
                    "actor_metrics": actor_metrics, "critic_metrics": critic_metrics}, Path(args.out) / f"dp{dp}.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
