"""Runs in the NeMo-Aligner venv with ``tests/trainers/apex_standin`` on PYTHONPATH (Apex importable, as on the
container): builds the actor the way a cluster run does — a preset's NeMo settings, ``build_actor`` →
``nemo_trainer`` → NeMo's ``get_specs`` (no test shim of it) — and the critic's layer spec as NeMo-Aligner's
critic model asks for it. Writes what was built and the actor's log-probs of fixed sequences to ``--out``.

    python tests/trainers/container_spec_driver.py --nemo DIR --out FILE [--preset qwen2.5-7b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import yaml  # noqa: E402

from nemo_factuality.testing import aligner_cpu  # noqa: E402

aligner_cpu.apply()

import torch  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402

from nemo_factuality.trainers.backends.aligner.actor import PRESET_DIR, build_actor  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout  # noqa: E402

TOKENS = [[5, 17, 33, 8, 90, 41, 7, 12], [9, 60, 2, 44, 31, 18, 77, 3]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen2.5-7b")
    args = ap.parse_args()
    assert gpt_layer_specs.HAVE_APEX, "the apex stand-in is not importable: run with tests/trainers/apex_standin on PYTHONPATH"
    preset = yaml.safe_load((PRESET_DIR / f"{args.preset}.yaml").read_text())["common"]["aligner"]
    # the preset's settings; what CPU cannot run is switched off: no TE (the local spec, the path a TE-less
    # machine takes), TP=1 (so no sequence parallelism), fp32
    model_overrides = {**aligner_cpu.CPU_MODEL_OVERRIDES, **preset, "transformer_engine": False,
                       "sequence_parallel": False, "megatron_amp_O2": False}
    overrides = [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "model.micro_batch_size=1",
                 "model.global_batch_size=2", "model.forward_micro_batch_size=2", "model.dtype=float32",
                 "model.optim.name=adamw", "model.optim.sched.name=constant", "remote_rm.url=http://127.0.0.1:5555"]
    actor = build_actor(load_train_config(GRPOConfig, None, overrides), max_steps=2, rollout_micro_batch_size=2,
                        model_overrides=model_overrides)
    roles = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")  # the layers' norms and the block's last
    norms = {role: sorted({f"{type(m).__module__}.{type(m).__name__}" for module in actor.model.get_model_module_list()
                           for name, m in module.named_modules() if name.endswith(role)}) for role in roles}
    tokens = torch.tensor(TOKENS)
    rollout = Rollout(tokens, torch.tensor([3, 3]), torch.tensor([tokens.shape[1]] * 2), torch.ones(2, dtype=torch.bool))
    logprobs = actor.logprobs(rollout)

    import nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model as reward_module

    # NeMo-Aligner's reward/critic model calls get_specs(spec_name, config) with no use_te: it must follow the
    # config's transformer_engine (false here) and the checkpoint's normalization
    critic_spec = reward_module.get_specs("", actor.model.transformer_config)
    critic_norms = sorted({getattr(s.submodules.input_layernorm, "__name__", str(s.submodules.input_layernorm))
                           for s in critic_spec.submodules.layer_specs} |
                          {getattr(critic_spec.submodules.layer_norm, "__name__", "")})
    Path(args.out).write_text(json.dumps({
        "normalization": actor.model.transformer_config.normalization, "norms": norms, "critic_norms": critic_norms,
        "tokens": TOKENS, "logprobs": logprobs.tolist()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
