"""Cluster-scale steps, measured on CPU with the tiny policy (each ratio from one run; the baseline in that run).

    python benchmarks/step_bench.py [--steps 4] [--only grpo,ppo,rollout,kto,onpolicy]

* **grpo / ppo** — the overlapped step (``<stage>.overlap_reward=true``) vs the sequential one, same seed, the
  trainers' steps interleaved (A B A B …) so machine load hits both alike. GRPO on KLCF's reward, PPO on
  RLFH's (its scalar: the tiny random policy's byte soup trips RLFH's token alignment), each with its real
  pipeline, served by ``nemo-factuality serve`` in its own process (the Slurm topology) and in the trainer's
  process; the scripted loopback judge runs in another process as a *saturated* judge: ``--judge-capacity``
  requests at a time, each taking the calibrated latency, so the reward's time grows with its work as a busy
  14B–72B judge's does. The latency is calibrated first so that the sequential reward phase lasts about as
  long as generation (the issue's setting).
* **rollout** — aligner backend (NeMo-Aligner's Megatron actor, the Aligner venv, world 1): rollout tokens/s
  for 128 prompts of 4–64 tokens, before (chunks of 16 in prompt order, as the backend generated) vs after
  (prompts bucketed by length; chunks of 16, 64 and 128 = the whole set, which a tiny model's KV budget allows).
* **kto** — KTO optimiser-step time with the reference log-probs computed once per iteration (split over DP)
  vs the z0 pairs' reference forward (``model.reference=cpu_weight_swap``) at every optimiser step.
* **onpolicy** — a GRPO step trained exactly on-policy with vs without the old-log-prob pass.

Every section prints the machine's load (``uptime``) before and after it: other jobs share the 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("generate", "reward", "reward_exposed", "logprobs", "train", "step")


def uptime() -> str:
    """``uptime``'s line (the load averages): other jobs share the machine."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except OSError:
        return "uptime unavailable"


# ---------------------------------------------------------------------------------------------- the judge
def judge_worker(delay_file: Path, capacity: int) -> None:
    """``--judge-worker``: the scripted method judge, ``capacity`` requests at a time, each taking the latency (ms)
    written in ``delay_file`` (read per request, so the benchmark can calibrate it without a restart)."""
    from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer, serve_until_terminated
    from nemo_factuality.testing.methods import method_judge

    busy = threading.Semaphore(capacity)

    def script(request: dict):
        reply = method_judge(request)
        delay = float(delay_file.read_text() or 0) / 1000
        with busy:  # a saturated judge: throughput capacity / latency
            time.sleep(delay)
        return reply

    serve_until_terminated(ScriptedOpenAIServer(script))


class Judge:
    """The judge process (off the trainer's GIL, as a judge is); ``delay_ms`` sets its latency."""

    def __init__(self, capacity: int, workdir: Path) -> None:
        self.delay_file = workdir / "judge_delay_ms"
        self.set_delay(0.0)
        self.proc = subprocess.Popen([sys.executable, __file__, "--judge-worker", f"--delay-file={self.delay_file}",
                                      f"--judge-capacity={capacity}"], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "PORT":
            raise RuntimeError("the judge process did not start")
        self.url = f"http://127.0.0.1:{line[1]}/v1"

    def set_delay(self, ms: float) -> None:
        self.delay_file.write_text(f"{ms}")
        self.delay_ms = ms

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------- GRPO / PPO overlap
STAGES = {"grpo": ("klcf", "tiny_cpu_klcf", "GRPOConfig"), "ppo": ("rlfh", "tiny_cpu_rlfh", "PPOConfig")}


def _reward_overrides(stage: str, judge_url: str) -> list[str]:
    if stage == "grpo":
        return [*(f"reward.{k}.base_url={judge_url}" for k in ("judge", "checklist_judge", "pipeline.extractor.judge",
                                                               "pipeline.verifier.judge")), "reward.w_rm=0", "reward.general_rm=null"]
    return [f"reward.judge.base_url={judge_url}"]


def _stage(stage: str, policy: Path, run_dir: Path, reward: list[str], data: Path, args, overlap: bool, chunk: int):
    """A GRPO (KLCF) or PPO (RLFH) trainer from the tiny_cpu presets; ``reward``: the reward's overrides."""
    import torch

    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic
    from nemo_factuality.trainers.data import load_prompts
    from nemo_factuality.trainers.runtime import build_reward

    method, preset, schema = STAGES[stage]
    rows = args.prompts * args.rollouts
    over = [f"model.path={policy}", f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false",
            f"model.length_params.max_length={args.max_length}", f"model.rollout_micro_batch_size={chunk}",
            f"data.train={data}", f"model.global_batch_size={rows}", f"model.micro_batch_size={rows // 2}",
            f"{stage}.overlap_reward={overlap}", *reward]
    if stage == "grpo":
        over += [f"grpo.num_prompts_per_step={args.prompts}", f"grpo.num_rollouts_per_prompt={args.rollouts}"]
    else:
        over += [f"ppo.num_prompts_per_step={rows}", f"critic.micro_batch_size={rows // 2}"]
    cfg = schemas.load_train_config(getattr(schemas, schema), preset, over)
    torch.manual_seed(0)
    actor = HFActor(cfg.model, max_steps=100)
    # RLFH's token placement is left out (tokenizer None: its scalar goes on the last action): the random tiny
    # policy's byte soup trips a token-alignment error in it (see the README's benchmark notes)
    reward_fn = build_reward(cfg, actor.tokenizer if stage == "grpo" else None)
    records = load_prompts(str(data), method)
    if stage == "grpo":
        from nemo_factuality.trainers.grpo import GRPOTrainer

        return GRPOTrainer(cfg, actor, reward_fn, records, run_dir=run_dir)
    from nemo_factuality.trainers.ppo import PPOTrainer

    critic = HFCritic(cfg.critic, cfg.model.path, max_steps=100)
    return PPOTrainer(cfg, actor, critic, reward_fn, records, run_dir=run_dir)


def _write_data(stage: str, d: Path, n: int) -> Path:
    from nemo_factuality.testing.methods import FACTS
    from nemo_factuality.testing.training import write_jsonl

    if stage == "grpo":
        return write_jsonl(d / "klcf.jsonl", [{"prompt": f"Tell me about Ada Varga, part {i}.",
                                               "checklist": ["Ada was born in 1917."]} for i in range(n)])
    return write_jsonl(d / "rlfh.jsonl", [{"question": f"When was Ada Varga born ({i})?", "titles": ["Ada Varga"],
                                           "materials": [FACTS[0][3]], "extra_materials": []} for i in range(n)])


def _mean_phases(rows: list[dict]) -> dict[str, float]:
    """Per phase, the median over steps (a shared machine's load spikes hit single steps)."""
    return {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES}


def _calibrate(make, judge: Judge, args) -> None:
    """Set the judge's latency so that the sequential reward phase lasts about as long as generation: for a
    saturated judge the reward time is ``a + b · latency``, measured at two latencies."""
    times = {}
    for delay in (0.0, args.calibration_delay_ms):
        judge.set_delay(delay)
        probe = make(False, args.chunk)
        probe.train_one_step()
        times[delay] = [probe.train_one_step() for _ in range(2)]
    r0, r1 = (statistics.mean(m["time/reward"] for m in times[d]) for d in times)
    generate = statistics.mean(m["time/generate"] for ms in times.values() for m in ms)
    judge.set_delay(max(0.0, (generate - r0) / max((r1 - r0) / args.calibration_delay_ms, 1e-6)))


def bench_overlap(stage: str, placement: str, tmp: Path, policy: Path, judge: Judge, args) -> dict:
    """Sequential vs overlapped steps, interleaved, the reward in-process or served by ``nemo-factuality serve``."""
    from contextlib import ExitStack

    from nemo_factuality.testing.servers import reward_server

    data = _write_data(stage, tmp, 64)
    with ExitStack() as stack:
        if placement == "served":
            server = stack.enter_context(reward_server(STAGES[stage][0], _reward_overrides(stage, judge.url),
                                                       tmp / f"serve_{stage}", {}))
            server["wait_ready"]()
            reward = ["reward=null", f"remote_rm.url={server['url']}"]
        else:
            reward = _reward_overrides(stage, judge.url)

        def make(overlap: bool, chunk: int):
            return _stage(stage, policy, tmp / f"{stage}_{placement}_{overlap}_{chunk}", reward, data, args, overlap, chunk)

        _calibrate(make, judge, args)
        trainers = {"sequential": make(False, args.chunk), "overlapped": make(True, args.chunk),
                    "sequential, one generate call": make(False, args.prompts * args.rollouts)}
        for trainer in trainers.values():
            trainer.train_one_step()  # warm-up
        rows: dict[str, list[dict]] = {mode: [] for mode in trainers}
        before = uptime()
        for _ in range(args.steps):
            for mode, trainer in trainers.items():
                rows[mode].append(trainer.train_one_step())
        after = uptime()
    return {"delay_ms": judge.delay_ms, "phases": {mode: _mean_phases(r) for mode, r in rows.items()}, "load": (before, after)}


def print_overlap(stage: str, placement: str, res: dict, args) -> None:
    rows = args.prompts * args.rollouts
    where = "in the trainer's process" if placement == "in-process" else "served by `nemo-factuality serve` (own process)"
    print(f"\n{stage.upper()} on {STAGES[stage][0].upper()}'s reward {where}; scripted judge in another process, "
          f"{args.judge_capacity} requests at a time, {res['delay_ms']:.1f} ms each (calibrated); {rows} responses of ≤ "
          f"{args.max_length} tokens per step, rollout micro batches of {args.chunk}; median of {args.steps} interleaved "
          "steps after a warm-up (s)")
    print(f"  load before: {res['load'][0]}\n  load after:  {res['load'][1]}")
    print(f"  {'':<32}" + "".join(f"{p:>15}" for p in PHASES))
    for mode, ph in res["phases"].items():
        print(f"  {mode:<32}" + "".join(f"{ph[p]:>15.3f}" for p in PHASES))
    seq, ovl = res["phases"]["sequential"]["step"], res["phases"]["overlapped"]["step"]
    one = res["phases"]["sequential, one generate call"]["step"]
    ph = res["phases"]["sequential"]
    print(f"  sequential reward / generate = {ph['reward'] / ph['generate']:.2f} (the calibration aims at 1)")
    print(f"  overlapped step {seq / ovl:.2f}× faster than the sequential one (same micro batches; target ≥ 1.6, limit 2); "
          f"{one / ovl:.2f}× vs the sequential step with one generate call")


# ---------------------------------------------------------------------------------------------- aligner rollouts
def rollout_worker(nemo: Path, out: Path, rounds: int) -> None:
    """``--rollout-worker`` (in the Aligner venv): rollout tokens/s before and after, on one actor."""
    from nemo_factuality.testing import aligner_cpu

    aligner_cpu.apply()
    import torch

    from nemo_factuality.trainers.backends.aligner.actor import build_actor
    from nemo_factuality.trainers.config import GRPOConfig, load_train_config
    from nemo_factuality.trainers.interfaces import SamplingParams

    cfg = load_train_config(GRPOConfig, None, [f"model.restore_from_path={nemo}", "trainer.backend=aligner",
                                               "model.dtype=float32", "model.optim.name=sgd", "remote_rm.url=http://x:1"])
    actor = build_actor(cfg, max_steps=10, rollout_micro_batch_size=16, model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    gen = torch.Generator().manual_seed(0)
    vocab = len(actor.tokenizer)
    prompts = [[int(t) for t in torch.randint(10, vocab - 10, (int(n),), generator=gen)]
               for n in torch.randint(4, 65, (128,), generator=gen)]
    prompts = [[t if t != actor.eos_id else t + 1 for t in p] for p in prompts]
    sampling = SamplingParams(max_new_tokens=32)

    def tokens_per_s(fn) -> tuple[float, float]:
        torch.manual_seed(0)
        start = time.perf_counter()
        rollouts = fn()
        wall = time.perf_counter() - start
        new = sum(int((r.response_lengths - r.prompt_lengths).sum()) for r in rollouts)
        return new / wall, wall

    def before():  # the backend's old order: consecutive chunks of 16 prompts, in prompt order
        actor.runtime.rollout_micro_batch_size = 16
        return [actor.generate(prompts[i : i + 16], sampling) for i in range(0, len(prompts), 16)]

    def after(batch: int):
        def run():
            actor.runtime.rollout_micro_batch_size = batch
            return [actor.generate(prompts, sampling)]
        return run

    after(16)()  # warm-up
    runs = {"before: 16, prompt order": before, **{f"after: {b}, bucketed": after(b) for b in (16, 64, 128)}}
    results: dict[str, list] = {name: [] for name in runs}
    for _ in range(rounds):  # interleaved rounds: load changes hit every configuration alike
        for name, fn in runs.items():
            results[name].append(tokens_per_s(fn))
    out.write_text(json.dumps(results))


def bench_rollout(tmp: Path, policy: Path, args) -> dict:
    from nemo_factuality.testing.aligner_env import aligner_venv, run_in_aligner_venv
    from nemo_factuality.testing.servers import convert_checkpoint

    venv = aligner_venv()
    if venv is None:
        return {"skipped": "the NeMo-Aligner venv is not built (tools/setup_stack_env.sh aligner)"}
    convert_checkpoint("hf-to-nemo", "--hf", str(policy), "--out", str(tmp / "policy_nemo"), "--extracted")
    before = uptime()
    res = run_in_aligner_venv(venv, [str(Path(__file__).relative_to(REPO)), "--rollout-worker", f"--steps={args.steps}",
                                     f"--nemo={tmp / 'policy_nemo'}", f"--out={tmp / 'rollout.json'}"], timeout=1800)
    if res.returncode:
        return {"skipped": f"the rollout worker failed: {res.stdout[-2000:]}"}
    return {"results": json.loads((tmp / "rollout.json").read_text()), "load": (before, uptime())}


def print_rollout(res: dict) -> None:
    print("\nAligner backend rollouts (NeMo-Aligner's Megatron actor, CPU/gloo, world 1; tiny Qwen2): 128 prompts of "
          "4–64 tokens, 32 new tokens each, sampled")
    if "skipped" in res:
        print(f"  skipped: {res['skipped']}")
        return
    print(f"  load before: {res['load'][0]}\n  load after:  {res['load'][1]}")
    rounds = len(next(iter(res["results"].values())))
    best = {name: max(tps for tps, _ in runs) for name, runs in res["results"].items()}
    median = {name: statistics.median(tps for tps, _ in runs) for name, runs in res["results"].items()}
    print(f"  tokens/s over {rounds} interleaved rounds: best (median)")
    for name in best:
        print(f"  {name:<28} {best[name]:>9.1f} ({median[name]:.1f})")
    base, base_m = best["before: 16, prompt order"], median["before: 16, prompt order"]
    print(f"  after at 128 (the whole set: a tiny model's KV budget allows it) vs before at 16: "
          f"{best['after: 128, bucketed'] / base:.2f}× best ({median['after: 128, bucketed'] / base_m:.2f}× median); "
          f"bucketing alone at 16: {best['after: 16, bucketed'] / base:.2f}× ({median['after: 16, bucketed'] / base_m:.2f}×)")


# ---------------------------------------------------------------------------------------------- KTO reference
def bench_kto(tmp: Path, policy: Path, args) -> dict:
    import torch

    from nemo_factuality.testing.training import half_good_labeller, prompts
    from nemo_factuality.trainers.backends.hf.actor import HFActor
    from nemo_factuality.trainers.config import KTOConfig
    from nemo_factuality.trainers.kto import KTOTrainer

    def one(precompute: bool, run: int) -> dict:
        cfg = KTOConfig()
        cfg.model.path, cfg.model.reference = str(policy), "cpu_weight_swap"
        cfg.model.length_params.max_length = args.kto_max_length
        cfg.model.global_batch_size, cfg.model.micro_batch_size = 8, 4
        cfg.kto.num_iterations, cfg.kto.prompts_per_iteration, cfg.kto.samples_per_prompt = 1, 16, 4
        cfg.kto.precompute_reference = precompute
        cfg.trainer.max_steps, cfg.trainer.progress_bar, cfg.trainer.save_interval = 1000, False, 0
        run_dir = tmp / f"kto_{precompute}_{run}"
        cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(run_dir), False
        torch.manual_seed(0)
        trainer = KTOTrainer(cfg, HFActor(cfg.model, max_steps=100), half_good_labeller, prompts(16), run_dir=run_dir)
        logged: list[dict] = []
        log = trainer.logger.log
        trainer.logger.log = lambda step, m: (logged.append(dict(m)), log(step, m))[-1]
        trainer.actor.reset_reference()
        start = time.perf_counter()
        trainer.data, stats = trainer.collect()
        collect_s = time.perf_counter() - start
        trainer.position = 0
        start = time.perf_counter()
        trainer.train_iteration_batches(preempted=False)
        train_s = time.perf_counter() - start
        steps = [m["time/reference_points"] + m["time/train"] for m in logged]
        return {"collect_s": collect_s, "steps": len(steps), "step_s": statistics.median(steps), "train_s": train_s}

    before = uptime()
    runs = {"before": [], "after": []}
    for run in range(2):  # interleaved: before, after, before, after
        runs["before"].append(one(False, run))
        runs["after"].append(one(True, run))
    return {"runs": runs, "load": (before, uptime())}


def print_kto(res: dict, args) -> None:
    runs = res["runs"]
    print(f"\nKTO optimiser step (hf backend, model.reference=cpu_weight_swap; 16 prompts × 4 samples ≤ {args.kto_max_length} "
          f"tokens, minibatches of 8, one iteration; two runs each, interleaved)")
    print(f"  load before: {res['load'][0]}\n  load after:  {res['load'][1]}")
    for name, label in (("before", "z0 pairs' reference at every step"), ("after", "reference once per iteration")):
        step = statistics.mean(r["step_s"] for r in runs[name])
        collect = statistics.mean(r["collect_s"] for r in runs[name])
        print(f"  {name:<7} ({label:<34}): {step * 1000:8.1f} ms per optimiser step ({runs[name][0]['steps']} steps), "
              f"collect {collect:.2f} s, iteration {collect + statistics.mean(r['train_s'] for r in runs[name]):.2f} s")
    b = statistics.mean(r["step_s"] for r in runs["before"])
    a = statistics.mean(r["step_s"] for r in runs["after"])
    print(f"  optimiser step: {b / a:.2f}× faster")


# ---------------------------------------------------------------------------------------------- on-policy pass
def bench_onpolicy(tmp: Path, policy: Path, args) -> dict:
    import torch

    from nemo_factuality.testing.training import good_fraction, prompts
    from nemo_factuality.trainers.backends.hf.actor import HFActor
    from nemo_factuality.trainers.config import GRPOConfig
    from nemo_factuality.trainers.grpo import GRPOTrainer

    class OldPass(GRPOTrainer):
        def reuses_training_logprobs(self) -> bool:
            return False

    def trainer(cls):
        cfg = GRPOConfig()
        cfg.model.path, cfg.model.length_params.max_length = str(policy), args.max_length
        rows = args.prompts * args.rollouts
        cfg.grpo.num_prompts_per_step, cfg.grpo.num_rollouts_per_prompt = args.prompts, args.rollouts
        cfg.model.global_batch_size = cfg.model.micro_batch_size = cfg.model.forward_micro_batch_size = rows
        cfg.grpo.truncated, cfg.reward = "keep", {"name": "toy"}
        cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(tmp / cls.__name__), False
        torch.manual_seed(0)
        return cls(cfg, HFActor(cfg.model, max_steps=100), good_fraction, prompts(16), run_dir=tmp / cls.__name__)

    trainers = {"with the old-log-prob pass": trainer(OldPass), "training forward's log-probs": trainer(GRPOTrainer)}
    rows: dict[str, list[dict]] = {k: [] for k in trainers}
    for t in trainers.values():
        t.train_one_step()
    before = uptime()
    for _ in range(args.steps):
        for name, t in trainers.items():
            rows[name].append(t.train_one_step())
    return {"phases": {k: _mean_phases(v) for k, v in rows.items()}, "load": (before, uptime())}


def print_onpolicy(res: dict, args) -> None:
    print(f"\nGRPO step trained exactly on-policy (hf, toy reward, {args.prompts * args.rollouts} responses, one minibatch; "
          f"median of {args.steps} interleaved steps, s)")
    print(f"  load before: {res['load'][0]}\n  load after:  {res['load'][1]}")
    for name, ph in res["phases"].items():
        print(f"  {name:<30} logprobs {ph['logprobs']:.3f}  train {ph['train']:.3f}  step {ph['step']:.3f}")
    old, new = res["phases"].values()
    saved = old["logprobs"] - new["logprobs"]  # the log-prob phase keeps the reference pass
    print(f"  the old-log-prob pass: {saved:.3f} s, {saved / old['step'] * 100:.1f}% of the old step "
          f"(step medians {old['step']:.3f} → {new['step']:.3f} s; generation dominates this toy-reward step)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="grpo,ppo,rollout,kto,onpolicy")
    p.add_argument("--steps", type=int, default=4, help="measured steps per mode (after one warm-up)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8, help="rollout micro batch (hf: model.rollout_micro_batch_size)")
    # the random tiny policy's longer responses mix special tokens into byte soup, which trips the sentence/token
    # alignment KTO needs (a known text-alignment limitation, README)
    p.add_argument("--kto-max-length", type=int, default=16)
    p.add_argument("--judge-capacity", type=int, default=4)
    p.add_argument("--calibration-delay-ms", type=float, default=20.0)
    p.add_argument("--placements", default="served,in-process", help="where the GRPO/PPO reward runs")
    p.add_argument("--judge-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--delay-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rollout-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nemo", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.judge_worker:
        judge_worker(args.delay_file, args.judge_capacity)
        return 0
    if args.rollout_worker:
        rollout_worker(args.nemo, args.out, args.steps)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from nemo_factuality.testing.training import build_policy

    only = set(args.only.split(","))
    print(f"step_bench: torch threads {torch.get_num_threads()}; {uptime()}")
    with tempfile.TemporaryDirectory(prefix="step_bench_") as tmp:
        tmp = Path(tmp)
        policy = build_policy(tmp / "policy")
        judge = Judge(args.judge_capacity, tmp)
        try:
            for stage in ("grpo", "ppo"):
                for placement in args.placements.split(","):
                    if stage in only:
                        print_overlap(stage, placement, bench_overlap(stage, placement, tmp, policy, judge, args), args)
        finally:
            judge.stop()
        if "rollout" in only:
            print_rollout(bench_rollout(tmp, policy, args))
        if "kto" in only:
            print_kto(bench_kto(tmp, policy, args), args)
        if "onpolicy" in only:
            print_onpolicy(bench_onpolicy(tmp, policy, args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
