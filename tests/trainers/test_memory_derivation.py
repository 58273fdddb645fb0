"""The megatron presets' memory arithmetic checked against what does not come from it (issue 39, item 8).

``test_megatron_presets.py`` checks that the presets' comments and the docs table are what
``backends.megatron.memory`` computes; this module checks ``backends.megatron.memory``'s inputs and terms against
independent sources:

* the parameter count: the real transformers model of each preset's architecture, built on the meta device (no
  memory), counted parameter by parameter — and the model cards' published sizes;
* the engine's KV cache per token: read off that model's attention projections (``k_proj``/``v_proj`` output
  widths), not from the ``2·L·kv·d`` formula;
* the parameters one GPU holds: that model's tensors walked one by one and placed as Megatron places them (the
  projections split over TP by rows or columns, the norms and the critic's value head whole, the layers over the
  pipeline stages, the embedding on the first and the output layer on the last), the busiest GPU taken;
* every phase's bytes (``_derived``): the element sizes from torch's dtypes, Adam's state from what torch's AdamW
  keeps, the activations kept under full recompute and one layer's working set from a per-tensor table (Korthikanti
  et al. 2022, Table 2: each tensor a layer keeps for its backward, split over TP or not), the logits of the loss
  and of the log-prob forward from the copies each op makes, a save from what each rank writes, and the GPU peaks with
  the engine's share and its process's CUDA context (on the trainer's GPU when colocated, on the engine's when
  separate).

Each check is shown to catch a wrong or missing term (the negative controls at the end): every term of the
derivation, taken out, breaks the agreement, and so does the arithmetic with one of its terms wrong.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import yaml

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.trainers.backends import memory as shared
from nemo_factuality.trainers.backends.megatron import memory as mm
from nemo_factuality.trainers.backends.megatron.memory import Engine, engine_bytes, plan
from nemo_factuality.trainers.backends.memory import GIB, H100_GIB, Arch

PRESETS = sorted((REPO_ROOT / "conf" / "train" / "megatron").glob("*.yaml"))
#: the model cards' "Number of Parameters" (Qwen2.5 7B/14B/32B; the R1 distills keep their base model's shape)
PUBLISHED = {"7b": 7.61e9, "14b": 14.7e9, "32b": 32.5e9}
PRESET_SIZE = {"7b": 28, "14b": 48, "32b": 64}  # layers of each size


def _hf_model(arch: dict) -> torch.nn.Module:
    return _hf_model_of(tuple(sorted(arch.items())))


@functools.cache
def _hf_model_of(items: tuple) -> torch.nn.Module:
    """One model per architecture (the R1 distills share Qwen2.5's), built once for the module."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = dict(items)
    cfg = Qwen2Config(hidden_size=arch["hidden"], num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"],
                      num_key_value_heads=arch["kv_heads"], intermediate_size=arch["ffn"], vocab_size=arch["vocab"],
                      tie_word_embeddings=arch.get("tied", False))
    with torch.device("meta"):
        return Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module", params=PRESETS, ids=lambda p: p.stem)
def preset(request) -> tuple[dict, torch.nn.Module]:
    data = yaml.safe_load(request.param.read_text())
    return data, _hf_model(data["arch"])


def _counted(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_parameter_count_is_the_real_models(preset):
    data, model = preset
    counted = _counted(model)
    assert Arch(**data["arch"]).parameters() == counted
    size = next(k for k in PUBLISHED if PRESET_SIZE[k] == data["arch"]["layers"])
    # the cards round loosely (Qwen2.5-32B's "32.5B" is 32.76B in its checkpoint); a missing output layer is 2.4%
    assert abs(counted - PUBLISHED[size]) / PUBLISHED[size] < 0.01, (size, counted)


def _kv_bytes_per_token(model: torch.nn.Module, tp: int, bytes_per_value: int = 2) -> int:
    """K and V for one token on one engine GPU, from the model's own projections (heads split over TP, whole)."""
    total = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        total += 2 * math.ceil(kv_heads / tp) * attn.head_dim * bytes_per_value
    return total


def test_the_engines_kv_cache_holds_what_the_models_projections_need(preset):
    data, model = preset
    arch = Arch(**data["arch"])
    for method in ("grpo", "kto"):
        engine = plan(data, method).engine
        if engine is None:
            continue
        got = engine_bytes(arch, engine)
        want = math.floor(got["kv_cache"] / (_kv_bytes_per_token(model, engine.tp) * engine.seq_len))
        assert got["sequences"] == want, (method, got["sequences"], want)


def _gpu_parameters(model: torch.nn.Module, tp: int, pp: int) -> int:
    """The parameters on the busiest GPU of ``model`` (an HF Qwen2 causal LM or token classifier) at TP×PP, its
    tensors placed one by one: Megatron splits the embedding and output layer by vocabulary rows, Q/K/V and the MLP's
    gate/up by output rows (biases with them), the attention output and MLP down projections by input columns; the
    norms and a value head stay whole on every TP rank. Layers go to stages in order, the embedding to the first,
    the final norm and the head to the last (a tied head is a copy of the embedding there)."""
    layers = model.config.num_hidden_layers
    stages = [0] * pp
    for name, tensor in model.named_parameters():
        whole = name.endswith("norm.weight") or name.startswith("score.")
        if not whole:
            assert tensor.shape[0 if "o_proj" not in name and "down_proj" not in name else 1] % tp == 0, name
        held = tensor.numel() if whole else tensor.numel() // tp
        if name.startswith("model.embed_tokens."):
            stage = 0
        elif name.startswith("model.layers."):
            stage = int(name.split(".")[2]) // (layers // pp)
        else:
            stage = pp - 1
        stages[stage] += held
    if model.config.tie_word_embeddings and pp > 1 and hasattr(model, "lm_head"):
        stages[-1] += model.model.embed_tokens.weight.numel() // tp
    return max(stages)


@functools.cache
def _critic_of(items: tuple) -> torch.nn.Module:
    import copy

    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(_hf_model_of(items).config)
    config.num_labels = 1
    with torch.device("meta"):
        return AutoModelForTokenClassification.from_config(config)


def test_each_gpu_holds_the_parameters_megatron_places_there(preset):
    """``Arch.stage_parameters`` equals the tensor walk exactly, for the trainer's layouts (policy and critic) and the
    engine's TP. Before it the arithmetic charged P/(TP·PP): 0.02% short with the norms every TP rank holds whole, and
    a critic at PP > 1 short by the embedding its first stage holds (qwen2.5-32b's PPO at TP=8 PP=2: 2.4%)."""
    data, model = preset
    arch = Arch(**data["arch"])
    critic = _critic_of(tuple(sorted(data["arch"].items())))
    for method in ("grpo", "ppo", "kto"):
        p = plan(data, method)
        tp, pp = p.layout.tp, p.layout.pp
        assert arch.stage_parameters(tp, pp) == _gpu_parameters(model, tp, pp), method
        assert arch.stage_parameters(tp, pp, value_head=True) == _gpu_parameters(critic, tp, pp), method
        assert arch.stage_parameters(p.engine.tp, 1) == _gpu_parameters(model, p.engine.tp, 1), method


def test_a_tied_model_keeps_its_embeddings_copy_on_the_last_stage():
    arch = {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 320, "tied": True}
    model = _hf_model(arch)
    for tp, pp in ((1, 1), (2, 1), (2, 2), (1, 4)):
        assert Arch(**arch).stage_parameters(tp, pp) == _gpu_parameters(model, tp, pp), (tp, pp)


BF16, FP32 = (torch.empty(0, dtype=d).element_size() for d in (torch.bfloat16, torch.float32))


def _adam_copies() -> int:
    """fp32 tensors per parameter the optimizer holds: the main weight and what torch's AdamW keeps per parameter."""
    weight = torch.nn.Parameter(torch.zeros(3))
    weight.grad = torch.ones(3)
    adam = torch.optim.AdamW([weight])
    adam.step()
    return 1 + sum(1 for v in adam.state[weight].values() if torch.is_tensor(v) and v.shape == weight.shape)


def _layer_tensors(s: int, b: int, h: int) -> list[tuple[str, int, bool]]:
    """(tensor, bytes, split over TP without sequence parallelism) a transformer layer keeps for its backward with
    flash attention (Korthikanti et al. 2022, Table 2; Megatron splits all of them with sequence parallelism)."""
    e = s * b * h  # one [s, b, h] activation's elements
    return [
        ("attention norm input", BF16 * e, False), ("attention norm output = QKV input", BF16 * e, False),
        ("Q", BF16 * e, True), ("K", BF16 * e, True), ("V", BF16 * e, True),
        ("attention output = output projection input", BF16 * e, True), ("attention dropout mask", e, False),
        ("MLP norm input", BF16 * e, False), ("MLP norm output = first linear input", BF16 * e, False),
        ("activation input (4h)", BF16 * 4 * e, True), ("second linear input (4h)", BF16 * 4 * e, True),
        ("MLP dropout mask", e, False),
    ]


def _activations(p, s: int, b: int, term) -> float:
    """Bytes of a training step's activations on the first pipeline stage (1F1B keeps PP micro batches in flight
    there): with full recompute each layer's input, and one layer's tensors while it is rerun; without, every
    layer's tensors."""
    lay, h = p.layout, p.arch.hidden
    in_flight, layers = lay.pp, p.arch.layers // lay.pp
    one_layer = term("working set", sum(n / lay.tp if (split or lay.sequence_parallel) else n
                                        for _, n, split in _layer_tensors(s, b, h)))
    if lay.recompute == "full":
        return term("kept", BF16 * s * b * h / (lay.tp if lay.sequence_parallel else 1) * layers * in_flight) + one_layer
    return one_layer * layers * in_flight


TERMS = ("weights", "grads", "adam", "critic", "reference", "kept", "working set", "loss logits", "forward logits",
         "overhead", "staged weights", "staged adam", "host reference", "engine weights", "kv", "engine CUDA context")
#: the colocated vLLM engine's process has its own CUDA context on the trainer's GPU, outside the share vLLM sizes as
#: gpu_memory_utilization × the GPU's memory (the context exists before vLLM measures anything): PyTorch's about
#: 0.5 GiB on an H100 with CUDA 12's lazy loading, plus cuBLAS and NCCL — an estimate of 0.8 GiB
ENGINE_CUDA_CONTEXT = 0.8 * GIB


def _derived(data: dict, method: str, without: str = "") -> dict[str, float]:
    """Every phase's bytes of ``method``'s plan, from the model and the element sizes (module docstring); ``without``:
    one of ``TERMS`` left out (the negative controls)."""
    def term(name: str, value: float) -> float:
        assert name in TERMS
        return 0.0 if name == without else value

    p = plan(data, method)
    lay, arch = p.layout, p.arch
    items = tuple(sorted(data["arch"].items()))
    policy = _gpu_parameters(_hf_model_of(items), lay.tp, lay.pp)
    critic = _gpu_parameters(_critic_of(items), lay.tp, lay.pp) if p.critic else 0
    dp = lay.dp if lay.distributed_optimizer else 1
    adam = _adam_copies() * FP32 / dp  # bytes per parameter on one GPU
    resident = (term("weights", BF16 * policy) + term("grads", FP32 * policy) + term("adam", adam * policy)
                + term("critic", (BF16 + FP32 + adam) * critic)
                + term("reference", BF16 * policy if p.reference_on_gpu else 0.0))
    overhead = term("overhead", lay.overhead_gib * GIB)
    logits = lay.seq_len * arch.vocab / lay.tp  # one sequence's logits on one TP rank
    train = (resident + _activations(p, lay.seq_len, lay.micro_batch, term) + overhead
             + term("loss logits", 3 * FP32 * logits * lay.micro_batch))  # fp32 logits, their softmax, the gradient
    # the log-prob forward: the bf16 output, its fp32 copy over the temperature, .float()'s temporary, the CE buffer
    forward = resident + term("forward logits", (BF16 + 3 * FP32) * logits * lay.forward_micro_batch) + overhead
    # a save: what a replica's first DP rank writes, staged on its host (weights and its Adam shard, of each model)
    host = (term("staged weights", BF16 * (policy + critic)) + term("staged adam", adam * (policy + critic))
            + term("host reference", 0.0 if p.reference_on_gpu else BF16 * policy))  # cpu_weight_swap keeps it there
    share = p.engine.gpu_memory_utilization * H100_GIB * GIB
    engine_weights = term("engine weights", BF16 * _gpu_parameters(_hf_model_of(items), p.engine.tp, 1))
    kv = share - engine_weights - mm.ENGINE_OVERHEAD_GIB * GIB
    per_token = term("kv", _kv_bytes_per_token(_hf_model_of(items), p.engine.tp))
    # the engine's share and its process's CUDA context sit beside the trainer (colocated) or on the engine's own GPU
    engine = share + term("engine CUDA context", ENGINE_CUDA_CONTEXT)
    colocated = p.engine.placement == "colocated"
    return {"train": train, "logprobs": forward, "save_gpu": resident + overhead, "save_host": host,
            "save_node": p.tasks_per_node * host, "engine_weights": engine_weights,
            "sequences": math.floor(kv / (per_token * p.engine.seq_len)) if per_token else math.inf,
            "trainer_peak": max(train, forward, resident + overhead) + (engine if colocated else 0.0),
            "engine_peak": 0.0 if colocated else engine}


def _arithmetic(data: dict, method: str) -> dict[str, float]:
    p = plan(data, method)
    phases, save, eng = mm.trainer_bytes(p), mm.save_bytes(p), mm.engine_bytes(p.arch, p.engine)
    peaks = mm.gpu_peaks(p)
    return {"train": phases["train"]["total"], "logprobs": phases["logprobs"]["total"], "save_gpu": save["gpu"]["total"],
            "save_host": save["host"]["total"], "save_node": save["host_node"]["total"],
            "engine_weights": eng["weights"], "sequences": eng["sequences"], "trainer_peak": peaks["trainer"],
            "engine_peak": peaks["engine"]}


def _disagreements(data: dict, method: str, derived: dict[str, float] | None = None) -> list[str]:
    derived = derived or _derived(data, method)
    got = _arithmetic(data, method)
    return [f"{k}: arithmetic {got[k]:.6g}, derived {derived[k]:.6g}" for k in derived
            if not math.isclose(got[k], derived[k], rel_tol=1e-9)]


def test_every_phase_equals_the_independent_derivation(preset):
    data, _ = preset
    for method in ("grpo", "ppo", "kto"):
        assert not _disagreements(data, method), method


def test_the_checks_catch_a_wrong_term():
    """Negative controls: the count with the Q/K/V biases left out, or the output layer tied, is not the real model's;
    a KV term that forgets to split the heads over the engine's TP is not the projections' either."""
    arch = {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "ffn": 18944, "vocab": 152064, "tied": False}
    model = _hf_model(arch)
    counted = _counted(model)
    assert Arch(**arch, qkv_bias=False).parameters() != counted
    assert Arch(**{**arch, "tied": True}).parameters() != counted
    unsplit = 2 * arch["layers"] * arch["kv_heads"] * (arch["hidden"] // arch["heads"]) * 2
    assert _kv_bytes_per_token(model, tp=2) != unsplit and _kv_bytes_per_token(model, tp=1) == unsplit
    wrong = Engine(tp=2, gpu_memory_utilization=0.5, placement="separate", seq_len=4096)
    kv = engine_bytes(Arch(**arch), wrong)["kv_cache"]
    assert math.floor(kv / (unsplit * 4096)) != engine_bytes(Arch(**arch), wrong)["sequences"]


def _variant(data: dict, sequence_parallel: bool, recompute: str) -> dict:
    megatron = {**data["common"]["model"]["megatron"], "sequence_parallel": sequence_parallel, "recompute": recompute}
    return {**data, "common": {**data["common"], "model": {**data["common"]["model"], "megatron": megatron}}}


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("recompute", ["full", "none"])
def test_the_activations_with_and_without_sequence_parallelism_and_recompute(sequence_parallel, recompute):
    """The presets all run SP with full recompute; the other three combinations of the qwen2.5-7b preset (TP=2, and
    PP=1 — the 32B PPO's PP=2 for the in-flight micro batches) agree with the derivation as well."""
    for name, method in (("qwen2.5-7b", "grpo"), ("qwen2.5-32b", "ppo")):
        data = _variant(yaml.safe_load((REPO_ROOT / "conf/train/megatron" / f"{name}.yaml").read_text()),
                        sequence_parallel, recompute)
        assert not _disagreements(data, method), (name, method)


def test_every_derived_term_is_needed_for_the_agreement():
    """Each term of the derivation left out breaks the agreement with the arithmetic: no term is too small for the
    comparison to see, so the arithmetic missing any of them would be caught. qwen2.5-32b's PPO (a critic, PP=2, the
    reference on the host) has all but the reference on the GPU; r1-distill-7b's KTO (model.reference=copy) that."""
    data = yaml.safe_load((REPO_ROOT / "conf/train/megatron/qwen2.5-32b.yaml").read_text())
    copy = _variant(yaml.safe_load((REPO_ROOT / "conf/train/megatron/qwen2.5-7b.yaml").read_text()), True, "full")
    copy["common"]["model"] = {**copy["common"]["model"], "reference": "copy"}
    assert not _disagreements(data, "ppo") and not _disagreements(copy, "kto")
    for name in TERMS:
        caught = _disagreements(data, "ppo", _derived(data, "ppo", without=name)) or \
            _disagreements(copy, "kto", _derived(copy, "kto", without=name))
        assert caught, name


def test_the_arithmetic_with_a_wrong_term_disagrees(monkeypatch):
    """The bug put back, one at a time: the P/(TP·PP) split used before (norms and a critic's first-stage embedding
    missed), no gradient buffer, no working set, the working set split over TP without sequence parallelism, 12 bytes
    per log-prob logit instead of 14, Adam's states whole on every DP rank, the engine's CUDA context not counted."""
    data = yaml.safe_load((REPO_ROOT / "conf/train/megatron/qwen2.5-32b.yaml").read_text())
    no_sp = _variant(data, False, "full")
    mutations = {
        "P/(TP·PP)": (shared.Arch, "stage_parameters", lambda self, tp, pp, value_head=False: (
            mm.critic_parameters(self) if value_head else self.parameters()) / (tp * pp)),
        "no gradient buffer": (mm, "parameter_states", lambda n, lay: {
            k: v for k, v in shared.parameter_states(n, lay).items() if k != "grads"}),
        "no working set": (shared, "layer_working_set", lambda sbh, lay: 0.0),
        "working set split without SP": (shared, "layer_working_set", lambda sbh, lay: 34 * sbh / lay.tp),
        "12 B per log-prob logit": (mm, "LOGPROB_BYTES_PER_LOGIT", 12),
        "Adam not sharded over DP": (mm, "parameter_states", lambda n, lay: {
            **shared.parameter_states(n, lay), "optimizer": 12.0 * n}),
        "no engine CUDA context": (mm, "ENGINE_CUDA_CONTEXT_GIB", 0.0),
    }
    for label, (owner, attr, value) in mutations.items():
        with monkeypatch.context() as m:
            m.setattr(owner, attr, value)
            assert _disagreements(data, "ppo") or _disagreements(no_sp, "ppo"), label
