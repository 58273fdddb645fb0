"""Runs in the megatron venv (``tools/setup_stack_env.sh megatron``) under torchrun on gloo: the megatron backend's GPU
settings (bf16 mixed precision, sequence parallelism, activation recompute, the distributed optimizer, the TE spec
choice), each run against the TP=1 fp32 run on ``megatron_driver``'s tiny Qwen2 and fixed batch.

    torchrun --nproc_per_node 1 tests/trainers/megatron_settings_driver.py first-step --hf DIR --out DIR --tag tp1 \
        --runs reference,bf16,recompute-full,recompute-selective --check-te
    torchrun --nproc_per_node 2 tests/trainers/megatron_settings_driver.py first-step --tp 2 --tag tp2 --runs sp ...
    torchrun --nproc_per_node 4 tests/trainers/megatron_settings_driver.py first-step --tp 2 --tag tp2dp2 \
        --runs exact,preset --train exact,preset ...
    torchrun --nproc_per_node 2 tests/trainers/megatron_settings_driver.py first-step --tag dp2 --runs distopt \
        --resume DIR/tp2dp2.preset ...

Each run (``--runs``, one after the other in the process, each a fresh actor) builds the actor with its settings,
generates greedily (4 prompts, 8 tokens), takes one AdamW step on the fixed batch (8 rows, micro batches of 2, each DP
rank its rows, the loss over the global token count) and records: what reached Megatron's configs, how often the
settings' own code ran during the step (recompute's checkpoints, SP's reduce-scatters), the step's metrics, the log-probs
before and after, and the step's reduced gradient before clipping — the fp32 ``main_grad`` after the DP reduction,
gathered over DP (distributed optimizer: each rank holds only its shard) and over TP by Bridge's own export, so it
comes out in the HF checkpoint's names whatever the layout (``<out>/<tag>.<run>.grad.pt``, written by global rank 0).

* ``--train RUN,…``: those runs go on — 2 more steps, save, a step, load, the same step again (the two must be equal).
* ``--resume DIR/TAG.RUN``: the ``preset`` settings at this layout load that run's fully reshardable checkpoint (the
  format for another TP/PP), save it again at once in that format (the two checkpoints must hold the same tensors)
  and take the step the saved run took after its save.
* ``--scale-loss F``: multiply every run's loss but the reference's by F (by hand: a gradient-scale bug must fail).
* ``--unfixed sp-norm``: the norms of the local spec unmarked for SP (by hand: SP's gradient check must fail).
* ``--check-te``: ``model.megatron.transformer_engine=true`` without TE is refused in one line; the spec choice.
* ``--check-graph-configs``: every megatron preset's settings (each stage) with rollouts on Megatron's dynamic engine
  on a GPU (its decode steps as CUDA graphs, ``inference_cuda_graphs``' default) through ``configure_provider`` on this
  tiny model's provider: Megatron-Core's own ``TransformerConfig`` validation — the config a GPU builds — and what
  reached it; and the same settings given to the provider as before the fix (full recompute set before validation).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_driver as base  # noqa: E402  (applies the CPU stand-ins before anything imports Megatron)
import torch  # noqa: E402

from nemo_factuality.trainers.interfaces import SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 33, 8], [9, 60], [120, 7, 7, 41, 300, 12], [2, 44, 31]]
_EXACT = ["model.megatron.use_distributed_optimizer=true", "model.megatron.recompute=full"]


def settings_of(run: str, tp: int) -> list[str]:
    """The config overrides of a named run. ``exact``/``preset``: the presets' combination (SP where TP > 1, the
    distributed optimizer, full recompute), in fp32 / in bf16."""
    sp = ["model.megatron.sequence_parallel=true"] if tp > 1 else []
    return {"reference": [], "bf16": ["model.dtype=bfloat16"], "recompute-full": ["model.megatron.recompute=full"],
            "recompute-selective": ["model.megatron.recompute=selective"],
            "sp": ["model.megatron.sequence_parallel=true"], "distopt": ["model.megatron.use_distributed_optimizer=true"],
            "exact": [*sp, *_EXACT], "preset": [*sp, *_EXACT, "model.dtype=bfloat16"]}[run]


# how often each setting's own code ran during the step (a setting silently off would match the reference trivially)
PROBES = {"checkpoint": 0, "reduce_scatter": 0}


def install_probes() -> None:
    import megatron.core.tensor_parallel.mappings as mappings
    from megatron.core import tensor_parallel

    def counting(key, fn):
        def wrapper(*args, **kwargs):
            PROBES[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    tensor_parallel.checkpoint = counting("checkpoint", tensor_parallel.checkpoint)
    mappings.dist_reduce_scatter_func = counting("reduce_scatter", mappings.dist_reduce_scatter_func)


def unfix(name: str) -> None:
    if name == "sp-norm":  # the norms exactly as Megatron's WrappedTorchNorm builds them, minus its SP assertion
        from nemo_factuality.trainers.backends.megatron import build as megatron_build

        build_norm = megatron_build.SequenceParallelTorchNorm.__new__

        def unmarked(cls, config, *args, **kwargs):
            norm = build_norm(cls, config, *args, **kwargs)
            for p in norm.parameters():
                p.sequence_parallel = False
            return norm

        megatron_build.SequenceParallelTorchNorm.__new__ = unmarked


def settings_reached(actor) -> dict:
    """What the built model, its DDP wrapper and its optimizer carry (Megatron's own config objects)."""
    cfg, chunk = actor.model.config, actor.chunks[0]
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    main_params = [p for o in optimizers for g in o.optimizer.param_groups for p in g["params"]]
    attention = actor.model.decoder.layers[0].self_attention
    return {
        "sequence_parallel": cfg.sequence_parallel, "recompute_granularity": cfg.recompute_granularity,
        "recompute_method": cfg.recompute_method, "recompute_num_layers": cfg.recompute_num_layers,
        "bf16": cfg.bf16, "fp16": cfg.fp16, "params_dtype": str(cfg.params_dtype), "pipeline_dtype": str(cfg.pipeline_dtype),
        "grad_reduce_in_fp32": chunk.ddp_config.grad_reduce_in_fp32,
        "ddp_distributed_optimizer": chunk.ddp_config.use_distributed_optimizer,
        "optimizer_bf16": optimizers[0].config.bf16, "optimizer_params_dtype": str(optimizers[0].config.params_dtype),
        "optimizers": sorted({type(o).__name__ for o in optimizers}),
        "wrappers": [type(chunk).__name__, type(chunk.module).__name__],
        "param_dtypes": sorted({str(p.dtype) for p in actor.model.parameters()}),
        "main_param_dtypes": sorted({str(p.dtype) for p in main_params}),
        "main_grad_dtypes": sorted({str(p.main_grad.dtype) for p in actor.model.parameters()}),
        "norms": sorted({type(m).__name__ for n, m in actor.model.named_modules() if n.endswith("layernorm")}),
        "norm_params_marked_sp": sum(bool(getattr(p, "sequence_parallel", False))
                                     for n, p in actor.model.named_parameters() if "layernorm" in n),
        "core_attention": type(attention.core_attention).__name__, "linear_qkv": type(attention.linear_qkv).__name__,
    }


def _owned_mask(actor, param: torch.nn.Parameter) -> torch.Tensor | None:
    """With the distributed optimizer: a flat 0/1 mask of the elements of ``param`` this DP rank's shard holds (its
    gradient is reduced there only); None without it."""
    if not actor.settings.distributed_optimizer:
        return None
    mask = torch.zeros(param.numel())
    for optimizer in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        try:
            owned = optimizer._get_model_param_range_map(param)["param"]
        except KeyError:  # another optimizer's parameter, or none of it in this rank's shard
            continue
        mask[owned.start:owned.end] = 1.0
    return mask


def reduced_gradient_hf(actor) -> dict[str, torch.Tensor]:
    """Every rank's reduced fp32 gradient (``main_grad``, before clipping) as full tensors in the HF checkpoint's
    names: completed over DP where the distributed optimizer reduce-scattered it, then gathered over TP/PP by Bridge's
    export with each weight's conversion task pointed at its gradient (the parameters are not touched: changing a
    bf16 parameter's ``.data`` to fp32 resets its gradient accumulator, and Megatron's DDP hooks with it). Collective."""
    from megatron.core import parallel_state

    grads = {}
    for p in actor.model.parameters():
        g = p.main_grad.detach().float().clone()
        mask = _owned_mask(actor, p)
        if mask is not None:
            g = (g.flatten() * mask).view_as(g)
            torch.distributed.all_reduce(g, group=parallel_state.get_data_parallel_group())
        grads[id(p)] = g
    tasks = [task if task is None or task.param_weight is None else replace(task, param_weight=grads[id(task.param_weight)])
             for task in actor.bridge.get_conversion_tasks(actor.chunks)]
    return {name: tensor.detach().float().clone() for name, tensor in actor.bridge.export_hf_weights(
        actor.chunks, cpu=True, show_progress=False, conversion_tasks=tasks)}


def capture_first_gradient(actor, into: dict) -> None:
    """Record ``reduced_gradient_hf`` once, right after the actor's gradient reduction of its first step."""
    reduce = actor._reduce_gradients

    def reducing() -> float:
        norm = reduce()
        if not into:
            into.update(reduced_gradient_hf(actor))
        return norm

    actor._reduce_gradients = reducing


def my_rows(actor, batch: dict) -> dict:
    dp, rank = actor.data_parallel_size, actor.data_parallel_rank
    return {k: v[rank * base.ROWS // dp : (rank + 1) * base.ROWS // dp] for k, v in batch.items()}


def make_step(actor, scale: float):
    batch = base.fixed_batch()
    mine, global_tokens = my_rows(actor, batch), float(batch["mask"].sum())
    loss = base.policy_loss(global_tokens)

    def scaled(out, mb):
        value, metrics = loss(out, mb)
        return value * scale, metrics

    return lambda: actor.train_step(mine, scaled if scale != 1.0 else loss, micro_batch_size=2)


def build(args, run: str):
    # the runs of one process share its Megatron groups, and the distributed-optimizer runs save in both formats
    # (train_on's .full.ckpt, resume's resave): the gloo groups that fully_reshardable save gathers on, built for all
    overrides = [*settings_of(run, args.tp), "model.optim.name=adamw", "model.optim.lr=0.01",
                 "trainer.gradient_clip_val=1.0", "model.optim.weight_decay=0.0",
                 "model.megatron.use_gloo_process_groups=true"]
    return base.build_actor(args, *overrides)


def first_step(args, run: str) -> dict:
    actor = build(args, run)
    rollout = base.as_rollout(base.fixed_batch())
    result = {"reached": settings_reached(actor), "dp": actor.data_parallel_size}
    greedy = actor.generate(PROMPTS, SamplingParams(max_new_tokens=8, use_greedy=True))
    result["greedy"] = greedy.tokens.tolist()
    result["sequence_parallel_after_generation"] = actor.model.config.sequence_parallel
    result["initial_logprobs"] = actor.logprobs(rollout).tolist()
    gradient: dict = {}
    capture_first_gradient(actor, gradient)
    step = make_step(actor, 1.0 if run == "reference" else args.scale_loss)
    PROBES.update(checkpoint=0, reduce_scatter=0)
    result["metrics1"] = step()
    result["probes"] = dict(PROBES)
    result["logprobs1"] = actor.logprobs(rollout).tolist()
    if torch.distributed.get_rank() == 0:
        torch.save(gradient, Path(args.out) / f"{args.tag}.{run}.grad.pt")
    if run in args.train.split(","):
        result.update(train_on(args, actor, run, step, rollout))
    return result


def train_on(args, actor, run: str, step, rollout) -> dict:
    """Two more steps, save, a step; load, the same step again (equal); the checkpoint stays for ``--resume`` (with the
    distributed optimizer also in ``fully_reshardable``, ``.full.ckpt``: the format a resume at another TP/PP reads)."""
    out = {"metrics": [step() for _ in range(2)]}
    ckpt = Path(args.out) / f"{args.tag}.{run}.ckpt"
    actor.save(ckpt)
    if actor.settings.distributed_optimizer:  # the route to another TP/PP (--resume reads it): the layout-change format
        base.save_as(actor, Path(args.out) / f"{args.tag}.{run}.full.ckpt", "fully_reshardable")
    out["logprobs_saved"] = actor.logprobs(rollout).tolist()
    out["metrics_a"], out["logprobs_a"] = step(), actor.logprobs(rollout).tolist()
    actor.load(ckpt)
    out["metrics_b"], out["logprobs_b"] = step(), actor.logprobs(rollout).tolist()
    actor.load_weights(ckpt)  # the stages' restore-best: the weights only
    out["main_weights_gap"] = main_weights_gap(actor)
    return out


def main_weights_gap(actor) -> float | None:
    """The largest difference between the optimizer's fp32 main weights and the bf16 weights they stand for (on this
    rank's slices); None without main copies (fp32). The optimizer steps the main weights and casts them back."""
    gap = None
    for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        if hasattr(o, "shard_fp32_from_float16_groups"):  # the distributed optimizer: a slice of each parameter
            pairs = [(model.detach().view(-1)[o._get_model_param_range_map(model)["param"].start:][:main.numel()], main)
                     for models, mains in zip(o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True)
                     for model, main in zip(models, mains, strict=True)]
        else:
            pairs = [(model, main) for models, mains in zip(getattr(o, "float16_groups", []),
                                                             getattr(o, "fp32_from_float16_groups", []), strict=True)
                     for model, main in zip(models, mains, strict=True)]
        for model, main in pairs:
            gap = max(gap or 0.0, float((model.float().view(-1) - main.detach().view(-1)).abs().max()))
    return gap


def resume(args) -> dict:
    """The ``preset`` settings at this layout: load ``--resume``'s checkpoint, save it again, take the saved run's next
    step; every tensor of the two checkpoints compared (all ranks load them whole; rank 0 reports)."""
    from megatron.core import dist_checkpointing

    actor = build(args, "preset")
    # another TP: the saved run's fully reshardable copy, saved again in that format (the default one, dp_reshardable,
    # loads only at its own TP/PP)
    actor.settings = replace(actor.settings, optimizer_checkpoint="fully_reshardable")
    rollout = base.as_rollout(base.fixed_batch())
    ckpt = Path(f"{args.resume}.full.ckpt")
    actor.load(ckpt)
    resaved = Path(args.out) / f"{args.tag}.resaved.ckpt"
    actor.save(resaved)
    result = {"reached": settings_reached(actor), "dp": actor.data_parallel_size,
              "resumed_logprobs": actor.logprobs(rollout).tolist()}
    result["metrics_resumed"] = make_step(actor, 1.0)()
    result["logprobs_resumed"] = actor.logprobs(rollout).tolist()
    saved = _flat(dist_checkpointing.load_plain_tensors(str(ckpt / "megatron")))
    again = _flat(dist_checkpointing.load_plain_tensors(str(resaved / "megatron")))
    result["checkpoint_keys"] = [len(saved), len(again), sorted(set(saved) ^ set(again))]
    result["checkpoint_dtypes"] = {k: str(v.dtype) for k, v in saved.items()}
    result["checkpoint_max_diff"] = max(float((saved[k].double() - again[k].double()).abs().max())
                                        for k in set(saved) & set(again))
    # the rest (Adam's step, the parameter groups) is in the checkpoints' common state
    result["checkpoint_common_equal"] = (repr(dist_checkpointing.load_common_state_dict(str(ckpt / "megatron")))
                                         == repr(dist_checkpointing.load_common_state_dict(str(resaved / "megatron"))))
    return result


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        elif torch.is_tensor(value):
            out[f"{prefix}{key}"] = value
    return out


def check_transformer_engine(args) -> dict:
    """``model.megatron.transformer_engine=true`` where TE is not importable: the build stops with one line naming
    the key. And the spec choice: Megatron-Core's TE layer spec (through Bridge) where TE is available, the local
    block spec otherwise (the TE spec itself can only be built where TE is)."""
    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.backends.megatron import build as megatron_build

    out = {}
    try:
        base.build_actor(args, "model.megatron.transformer_engine=true")
        out["refusal"] = None
    except ConfigError as err:
        out["refusal"] = str(err)
    from megatron.bridge.models.gpt_provider import transformer_engine_layer_spec

    bridge = megatron_build.import_auto_bridge().from_hf_pretrained(args.hf, torch_dtype=torch.float32)
    layout = megatron_build.ParallelLayout(args.tp, args.pp, 1)
    chosen = {}
    available = megatron_build.transformer_engine_available
    try:
        megatron_build.transformer_engine_available = lambda: True
        for te in (True, False):
            provider = bridge.to_megatron_provider(load_weights=False)
            megatron_build.configure_provider(provider, layout, megatron_build.Settings(transformer_engine=te))
            chosen[str(te)] = provider.transformer_layer_spec
    finally:
        megatron_build.transformer_engine_available = available
    out["te_spec_is_megatrons"] = chosen["True"] is transformer_engine_layer_spec
    out["local_spec_is_the_block_spec"] = chosen["False"] is megatron_build.local_block_spec
    return out


def check_graph_configs(args) -> dict:
    """Per ``preset/stage``: ``{"ok", "error", "recompute", "graphs", "before"}`` (module docstring)."""
    from megatron.bridge import AutoBridge

    from nemo_factuality.config import REPO_ROOT, load_config
    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.backends.megatron import build as megatron_build
    from nemo_factuality.trainers.backends.memory import ParallelLayout
    from nemo_factuality.trainers.presets import load_preset

    stages = {"grpo": schemas.GRPOConfig, "ppo": schemas.PPOConfig, "kto": schemas.KTOConfig}
    bridge = AutoBridge.from_hf_pretrained(str(megatron_build.in_installed_config_layout(args.hf)))
    out = {}
    for path in sorted((REPO_ROOT / "conf" / "train" / "megatron").glob("*.yaml")):
        for stage, schema in stages.items():
            overrides, _ = load_preset("megatron", path.stem, stage)
            cfg = load_config(schema, None, [*overrides, f"model.path={args.hf}", "rollout.engine=megatron",
                                             "model.megatron.inference_engine=dynamic"], group="train")
            # this tiny model's heads split over 2 ranks at most; the TE spec is not here (neither changes the check)
            settings = replace(megatron_build.Settings.of(cfg.model, on_gpu=True), transformer_engine=False)
            layout = ParallelLayout(min(cfg.model.tensor_model_parallel_size, 2), 1, 1)
            result = {"graphs": settings.cuda_graphs, "preset_recompute": settings.recompute}
            for when in ("before", "now") if stage == "grpo" else ("now",):  # "before" once a preset
                provider = bridge.to_megatron_provider(load_weights=False)  # a new provider (config) each time
                try:
                    if when == "before":  # the settings as configure_provider gave them until the fix
                        provider.recompute_granularity, provider.recompute_method = "full", "uniform"
                        provider.recompute_num_layers, provider.cuda_graph_impl = 1, "local"
                        provider.tensor_model_parallel_size = layout.tp
                        provider.sequence_parallel = settings.sequence_parallel
                        provider.finalize()
                    else:
                        megatron_build.configure_provider(provider, layout, settings)
                    result[when] = None
                except AssertionError as err:
                    result[when] = str(err)
                if when == "now":
                    result["recompute"] = provider.recompute_granularity
                    result["cuda_graph_impl"] = provider.cuda_graph_impl
            out[f"{path.stem}/{stage}"] = result
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["first-step"])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--runs", default="", help="comma-separated: reference, bf16, recompute-full, recompute-selective, "
                                               "sp, distopt, exact, preset")
    ap.add_argument("--train", default="", help="comma-separated runs that go on: steps, save → step → load → step")
    ap.add_argument("--resume", default=None, help="OUT/TAG.RUN of a --train run: resume it at this layout (preset)")
    ap.add_argument("--scale-loss", type=float, default=1.0)
    ap.add_argument("--unfixed", choices=["sp-norm"], default=None)
    ap.add_argument("--check-te", action="store_true")
    ap.add_argument("--check-graph-configs", action="store_true")
    args = ap.parse_args()
    install_probes()
    if args.unfixed:
        unfix(args.unfixed)
    results = {}
    for run in filter(None, args.runs.split(",")):
        results[run] = first_step(args, run)
        gc.collect()
    if args.resume:
        results["resume"] = resume(args)
    if args.check_te:
        results["te"] = check_transformer_engine(args)
    if args.check_graph_configs:
        results["graph_configs"] = check_graph_configs(args)
    rank = torch.distributed.get_rank()
    (Path(args.out) / f"{args.tag}.rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
