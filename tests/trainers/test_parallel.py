"""Data parallelism in the stages without a cluster: sharding, the start-up checks, metric reduction,
global whitening, and the checkpoint protocol (two ranks as two threads sharing a barrier)."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from nemo_factuality.algorithms import masked_whiten
from nemo_factuality.config import ConfigError
from nemo_factuality.trainers.parallel import (
    DataParallel,
    data_parallel_problems,
    masked_whiten_global,
    metric_vector,
    reduced_metrics,
    shard,
)
from nemo_factuality.trainers.runtime import Checkpointer, RunLogger


def test_each_rank_takes_a_contiguous_equal_slice():
    drawn = [7, 3, 5, 1, 0, 6]
    assert [shard(drawn, r, 2) for r in range(2)] == [[7, 3, 5], [1, 0, 6]]
    assert DataParallel(object()).shard(drawn) == drawn  # an actor without a layout is world 1
    with pytest.raises(ValueError):
        shard(drawn, 0, 4)


def test_batches_that_do_not_split_over_ranks_are_named():
    assert data_parallel_problems(1, "grpo.num_prompts_per_step", 3, 8, 16, 8) == []
    assert data_parallel_problems(2, "grpo.num_prompts_per_step", 4, 8, 16, 8) == []
    (msg,) = data_parallel_problems(2, "grpo.num_prompts_per_step", 3, 8, 24, 4)
    assert "grpo.num_prompts_per_step (3)" in msg and "data-parallel size (2)" in msg
    (msg,) = data_parallel_problems(4, "ppo.num_prompts_per_step", 8, 1, 6, 1)
    assert "model.global_batch_size (6" in msg
    (msg,) = data_parallel_problems(2, "grpo.num_prompts_per_step", 4, 8, 16, 16)
    assert "model.micro_batch_size (16)" in msg
    # PPO's critic trains on the same per-rank share (8 sequences here): a critic micro batch of 3 was refused only at
    # the first update, by a message naming no key
    other = {"critic.micro_batch_size": 3}
    (msg,) = data_parallel_problems(2, "ppo.num_prompts_per_step", 4, 4, 16, 4, other_micro_batch_sizes=other)
    assert "critic.micro_batch_size (3)" in msg and "16 / 2 = 8 sequences per rank" in msg
    assert data_parallel_problems(2, "ppo.num_prompts_per_step", 4, 4, 16, 4,
                                  other_micro_batch_sizes={"critic.micro_batch_size": 4}) == []


class _Layout:
    """What the aligner actor exposes, without the model (only the start-up checks run)."""

    def __init__(self, tokenizer, size=2, rank=0):
        self.tokenizer, self.data_parallel_size, self.data_parallel_rank, self.global_rank = tokenizer, size, rank, rank
        self.eos_id = self.pad_id = 0


def test_the_stages_refuse_a_layout_their_batches_do_not_fit(tiny_policy, tmp_path):
    from transformers import AutoTokenizer

    from nemo_factuality.testing.training import prompts
    from nemo_factuality.trainers.config import GRPOConfig, KTOConfig
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.kto import KTOTrainer

    actor = _Layout(AutoTokenizer.from_pretrained(str(tiny_policy)))
    cfg = GRPOConfig()
    cfg.grpo.num_prompts_per_step, cfg.model.global_batch_size = 3, 24
    with pytest.raises(ConfigError, match=r"grpo\.num_prompts_per_step \(3\)"):
        GRPOTrainer(cfg, actor, None, prompts(4), run_dir=tmp_path)
    kto = KTOConfig()
    kto.kto.prompts_per_iteration = 3
    with pytest.raises(ConfigError, match=r"kto\.prompts_per_iteration \(3\)"):
        KTOTrainer(kto, actor, None, prompts(4), run_dir=tmp_path)


def test_kto_splits_a_minibatch_over_ranks_padding_with_weight_0_rows():
    from nemo_factuality.trainers.kto import rank_rows

    positions, weight = rank_rows(4, 0, 1, 2)  # world 1, whole micro batches: the minibatch as it is
    assert positions.tolist() == [0, 1, 2, 3] and weight.tolist() == [1, 1, 1, 1]
    # world 1, 3 rows in micro batches of 2: a weight-0 row fills the last (the megatron and aligner actors take equal
    # micro batches only; the megatron KTO stage at TP=2 stopped on this minibatch before)
    positions, weight = rank_rows(3, 0, 1, 2)
    assert positions.tolist() == [0, 1, 2, 0] and weight.tolist() == [1, 1, 1, 0]
    split = [rank_rows(3, r, 2, 1) for r in range(2)]
    assert [p.tolist() for p, _ in split] == [[0, 1], [2, 0]] and [w.tolist() for _, w in split] == [[1, 1], [1, 0]]
    split = [rank_rows(5, r, 2, 2) for r in range(2)]  # each rank: a whole number of micro batches
    assert [p.tolist() for p, _ in split] == [[0, 1, 2, 3], [4, 0, 0, 0]] and split[1][1].tolist() == [1, 0, 0, 0]


def _two_ranks(per_rank: list[dict[str, float]], sums=()) -> list[dict[str, float]]:
    keys = sorted(per_rank[0])
    total = sum(metric_vector(m, sorted(m), set(sums)) for m in per_rank)
    return reduced_metrics(total, keys, set(sums), len(per_rank))


def test_metrics_are_means_over_ranks_sums_for_counts_and_skip_nan():
    out = _two_ranks([{"reward": 0.2, "labelled": 3.0, "kl": math.nan}, {"reward": 0.6, "labelled": 5.0, "kl": 0.1}],
                     sums=("labelled",))
    assert out == pytest.approx({"reward": 0.4, "labelled": 8.0, "kl": 0.1})
    assert math.isnan(_two_ranks([{"x": math.nan}, {"x": math.nan}])["x"])
    with pytest.raises(RuntimeError, match="different metric names"):
        keys = ["a", "b"]
        total = metric_vector({"a": 1.0, "b": 2.0}, keys, set()) + metric_vector({"a": 1.0, "c": 2.0}, ["a", "c"], set())
        reduced_metrics(total, keys, set(), 2)


def test_whitening_over_ranks_equals_whitening_the_whole_batch():
    torch.manual_seed(0)
    values, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    whole = masked_whiten(values, mask, unbiased=True)
    alone = masked_whiten_global(values, mask, lambda t: t, unbiased=True)
    assert torch.allclose(alone, whole, atol=1e-5)
    halves = [(values[:3], mask[:3]), (values[3:], mask[3:])]

    def over_both(rank):
        # what an all-reduce returns: each call sums the same statistic computed on both halves
        calls = iter([0, 1])

        def reduce(t):
            step = next(calls)
            if step == 0:
                return sum(torch.stack([m.sum(), (v * m).sum()]).double() for v, m in halves)
            mean = float(sum((v * m).sum() for v, m in halves) / mask.sum())
            return sum((((v.double() - mean) ** 2) * m).sum().reshape(1) for v, m in halves)

        v, m = halves[rank]
        return masked_whiten_global(v, m, reduce, unbiased=True)

    assert torch.allclose(torch.cat([over_both(0), over_both(1)]), whole, atol=1e-5)


class _RankActor:
    """Two ranks of a collective actor as threads: ``save`` writes this rank's shard, ``barrier`` waits for both."""

    def __init__(self, rank: int, barrier: threading.Barrier):
        self.data_parallel_size, self.data_parallel_rank, self.global_rank = 2, rank, rank
        self._barrier = barrier

    def barrier(self) -> None:
        self._barrier.wait(timeout=30)

    def save(self, path: Path) -> None:
        assert path.is_dir()  # rank 0 made the shared temporary directory before anyone writes
        (path / f"shard{self.global_rank}").write_text("x")
        self.barrier()

    def load(self, path: Path) -> None:
        assert (path / f"shard{self.global_rank}").exists()


def test_every_rank_writes_one_checkpoint_and_rank_0_alone_finalises_it(tmp_path):
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def rank(r: int) -> None:
        try:
            actor = _RankActor(r, barrier)
            ckpt = Checkpointer(tmp_path, keep=1, parallel=DataParallel(actor))
            for step in (1, 2):
                results[r] = ckpt.save(step, actor, None, {"step": step}, extra=lambda p: (p / "extra").write_text("0"))
            results[f"state{r}"] = ckpt.load(ckpt.latest(), actor, None)
        except Exception as err:  # surfaced below: a failing thread must fail the test
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    root = tmp_path / "checkpoints"
    assert results[0] == results[1] == root / "step_000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]  # pruned, no temporary left
    assert sorted(p.name for p in results[0].iterdir()) == ["extra", "rng.pt", "rng.rank1.pt", "shard0", "shard1",
                                                            "trainer_state.json"]
    assert results["state0"]["step"] == results["state1"]["step"] == 2


def test_only_rank_0_logs(tmp_path):
    from nemo_factuality.trainers.config import GRPOConfig

    exp = GRPOConfig().exp_manager
    exp.create_tensorboard_logger = False
    quiet = RunLogger(tmp_path, exp, None, enabled=False)
    quiet.log(1, {"x": 1.0})
    quiet.truncate_after(0)
    quiet.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_critic_servers_micro_batch_splits_the_gathered_minibatch_not_each_ranks_share():
    """The aligner backend's critic server takes one step on the minibatch gathered from every rank, so only an
    in-process critic (hf, megatron) must split each rank's share (its check refused the aligner PPO at DP=2)."""
    from types import SimpleNamespace

    from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic
    from nemo_factuality.trainers.ppo import PPOTrainer

    cfg = SimpleNamespace(critic=SimpleNamespace(micro_batch_size=4))
    server = SimpleNamespace(critic=object.__new__(RemoteCritic), cfg=cfg)
    in_process = SimpleNamespace(critic=object(), cfg=cfg)
    assert PPOTrainer._other_micro_batch_sizes(server) == {}
    assert PPOTrainer._other_micro_batch_sizes(in_process) == {"critic.micro_batch_size": 4}
