"""Runs under torchrun (gloo): the GRPO stage at TP=2 where ONE rank — tensor-parallel rank 1, not its replica's source —
runs out of memory inside a model forward, and the job must end at once rather than wait in a collective.

    torchrun --nproc_per_node 2 tests/trainers/fail_fast_driver.py --hf DIR --out DIR --phase generate
    torchrun --nproc_per_node 2 tests/trainers/fail_fast_driver.py --nemo DIR --out DIR --phase logprobs

``--hf``: the megatron backend (in the megatron venv); ``--nemo``: the aligner backend (in the NeMo-Aligner venv). At
step 2, on global rank 1 only, a forward pre-hook on the first decoder layer raises CUDA's out-of-memory error
(``torch.OutOfMemoryError``, what the caching allocator raises) in the phase given: ``generate`` (the rollout's forward)
or ``logprobs`` (the old log-probs' forward; the step's minibatches are smaller than its rollout, so that forward runs).
By then the embedding's all-reduce has run on both ranks, and rank 0 waits in the first layer's: the two ranks are
inside the forward's own tensor-parallel collectives, as on a GPU.

Before the fix rank 1 took the error to the stage's agreement (a WORLD all-reduce) while rank 0 waited in the layer's
tensor-parallel all-reduce: the job sat until ``trainer.distributed_timeout_s``. Now rank 1 logs the error with its
traceback and exits, entering no collective, and torchrun ends the job. Rank 1 writes ``<out>/fault.json`` (the wall
clock when it raised) before raising; the test measures from it to torchrun's exit. The group timeout is minutes
(``--group-timeout``), far longer than the bound the test sets on the job's end.

``--phase refit-enospc`` (megatron): rollouts on an engine (``rollout.engine=vllm`` on ``testing.scripted_engine``,
started by the source rank as the stage starts it) refit by file into ``rollout.vllm.weights_dir``, where the source's
disk is full: step 2's write fails with ENOSPC on the source while rank 1 has finished the collective export. Each rank writes ``<out>/rank<r>.code``, the exit code the command boundary gave it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ON_ALIGNER = "--nemo" in " ".join(sys.argv)
if ON_ALIGNER:
    from nemo_factuality.testing import aligner_cpu

    aligner_cpu.apply()
else:
    from nemo_factuality.testing import megatron_cpu

    megatron_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.cli import run_command  # noqa: E402
from nemo_factuality.testing.training import good_fraction, prompts  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.grpo import GRPOTrainer  # noqa: E402

FAULT_STEP = 2


def overrides(args, run_dir: Path) -> list[str]:
    model = ([f"model.restore_from_path={args.nemo}", "trainer.backend=aligner"] if args.nemo
             else [f"model.path={args.hf}", "trainer.backend=megatron"])
    return model + ["model.tensor_model_parallel_size=2", "trainer.max_steps=3",
                    f"trainer.distributed_timeout_s={args.group_timeout}", "trainer.save_interval=1",
                    "trainer.progress_bar=false", "grpo.num_prompts_per_step=4", "grpo.num_rollouts_per_prompt=2",
                    "grpo.truncated=keep", "model.micro_batch_size=2", "model.global_batch_size=4",
                    "model.forward_micro_batch_size=2", "model.rollout_micro_batch_size=4",
                    "model.length_params.max_length=5", "model.dtype=float32", "model.optim.name=sgd",
                    "model.optim.lr=0.05", "model.optim.sched.name=constant", "remote_rm.url=http://127.0.0.1:9",
                    "remote_rm.timeout_s=1", "remote_rm.retry.max_wait_s=3",
                    f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false"]


class OutOfMemoryOnRank1:
    """Arms a forward pre-hook on the first decoder layer: at step ``FAULT_STEP``'s ``phase`` on global rank 1 it raises
    ``torch.OutOfMemoryError``; everywhere else it does nothing. ``generate_chunks`` counts the steps (one rollout a
    step) and marks the phase; ``logprobs`` marks its own."""

    def __init__(self, actor, phase: str, out: Path) -> None:
        self.actor, self.phase, self.out, self.step, self.current = actor, phase, out, 0, None
        self.mine = torch.distributed.get_rank() == 1
        layer = next(m for name, m in actor.model.named_modules() if name.endswith("layers.0"))
        layer.register_forward_pre_hook(self._hook)
        generate_chunks, logprobs = actor.generate_chunks, actor.logprobs

        def counted_generate_chunks(prompt_ids, sampling):
            self.step += 1
            self.current = "generate"
            try:
                yield from generate_chunks(prompt_ids, sampling)
            finally:
                self.current = None

        def marked_logprobs(*a, **kw):
            self.current = "logprobs"
            try:
                return logprobs(*a, **kw)
            finally:
                self.current = None

        actor.generate_chunks, actor.logprobs = counted_generate_chunks, marked_logprobs

    def _hook(self, _module, _inputs):
        if self.mine and self.step == FAULT_STEP and self.current == self.phase:
            self.out.joinpath("fault.json").write_text(json.dumps({"phase": self.phase, "at": time.time(),
                                                                   "step": self.step}))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1 in the "
                                         f"{self.phase} forward of step {self.step})")


def main() -> int:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--nemo", help="aligner backend: the policy's extracted .nemo")
    which.add_argument("--hf", help="megatron backend: the policy's HF folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["generate", "logprobs", "refit-enospc"], required=True)
    ap.add_argument("--group-timeout", type=float, default=300.0,
                    help="trainer.distributed_timeout_s: minutes, so only a fail-fast path ends the job in seconds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as the CLI does
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = enospc_refit(out) if args.phase == "refit-enospc" else []
    cfg = load_train_config(GRPOConfig, None, overrides(args, out / "run") + extra)
    if args.nemo:
        from nemo_factuality.trainers.backends.aligner.actor import build_actor

        actor = build_actor(cfg, max_steps=10, rollout_micro_batch_size=4,
                            model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    else:
        from nemo_factuality.trainers.backends import BACKENDS

        actor, _ = BACKENDS.get("megatron")(cfg)
    if extra:
        from nemo_factuality.trainers.engines.vllm_rollout import with_rollout_engine

        actor = with_rollout_engine(cfg, actor, out / "run")
    else:
        OutOfMemoryOnRank1(actor, args.phase, out)
    trainer = GRPOTrainer(cfg, actor, good_fraction, prompts(8), run_dir=out / "run")
    try:
        code = run_command(lambda _argv: trainer.fit() and 0, [], "train grpo")
    finally:
        getattr(actor, "close", lambda: None)()  # the engine, as the stage command closes it
    (out / f"rank{torch.distributed.get_rank()}.code").write_text(str(code))
    return code


def enospc_refit(out: Path) -> list[str]:
    """The overrides of ``--phase refit-enospc``: the scripted engine, and on the source (global rank 0) a disk that
    fills at the first refit: safetensors' writer raises ENOSPC there after writing part of the file, as a full
    filesystem does (safetensors writes a temporary file and renames it, so no device file can stand in for it)."""
    import errno

    import safetensors.torch

    from nemo_factuality.testing.scripted_engine import engine_python

    if int(os.environ["RANK"]) == 0:
        engine_python(out / "engine", {})

        def disk_full(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"\0" * 4096)  # what got written before the disk filled
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

        safetensors.torch.save_file = disk_full
    return ["rollout.engine=vllm", f"rollout.vllm.python={out / 'engine' / 'python'}",
            f"rollout.vllm.weights_dir={out / 'weights'}", "rollout.vllm.reply_timeout_s=10",
            "rollout.vllm.request_timeout_s=10", "rollout.vllm.start_timeout_s=30"]


if __name__ == "__main__":
    raise SystemExit(main())
