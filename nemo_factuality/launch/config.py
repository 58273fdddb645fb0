"""Typed schemas for ``nemo-factuality launch``: the stage (what runs) and the cluster profile (where)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterProfile:
    """``conf/cluster/<name>.yaml``: site settings, independent of the stage.

    ``container_mounts``: pyxis ``--container-mounts`` of every step (``/lustre:/lustre``, …).
    """

    account: str | None = None  # sbatch --account
    partition: str | None = None  # sbatch --partition
    gpus_per_node: int = 8  # GPUs per node of the partition
    # sbatch --cpus-per-task of every het group, and srun --cpus-per-task of every step (Slurm 22.05-23.02's srun does
    # not inherit sbatch's: without it each task would get one CPU); null = the site's default
    cpus_per_task: int | None = None
    # NUMA node of each GPU 0..gpus_per_node-1 (`nvidia-smi topo -m`, column "NUMA Affinity"): the steps with one task
    # per GPU (trainer, critic) bind task i's CPUs to GPU i's NUMA node (srun --cpu-bind=map_ldom:..., --mem-bind=local);
    # empty = no CPU binding (the site's default)
    gpu_numa_nodes: list[int] = field(default_factory=list)
    # sbatch --mem of the trainer's group, and of a server group (or the critic's) with a GPU server that declares
    # no mem_gb; e.g. "0" = all memory of the node. Every other server group asks what its servers need (mem_gb).
    mem: str | None = None
    # memory of one node of the partition in GiB (`scontrol show node`: RealMemory, in MiB, / 1024); null = unknown.
    # When known, servers are packed onto a group's nodes by memory too, a server needing more is refused, and a
    # group's --mem (headroom included) is capped at it.
    node_mem_gb: float | None = None
    time_limit: str = "04:00:00"  # sbatch --time
    # pyxis/enroot images (squashfs path or registry URI) by the name a step asks for (ServerSpec.image; the trainer
    # runs its backend's: `trainer` for hf and aligner, `megatron` for megatron): `trainer` = `docker build .`,
    # `judge` = `docker build --target judge .` (vLLM), `megatron` = `docker build --target megatron .`.
    # Empty = bare metal: every step runs in the submitting environment.
    images: dict[str, str] = field(default_factory=dict)
    # the interpreter with vLLM that a trainer's rollout engines run in (rollout.engine=vllm), exported to the trainer
    # step as NEMO_FACTUALITY_VLLM_PYTHON: the megatron image's /opt/vllm/bin/python (the Dockerfile), or a vLLM
    # venv on bare metal; null = the image's own setting
    vllm_python: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    # pyxis --container-workdir of the steps running the `trainer` image (where this package lives in it); a step in
    # another image (vLLM's `judge`) starts in that image's own directory: pyxis fails a step whose workdir is missing
    container_workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # NCCL / TE / HF settings exported to every step
    log_root: str = "logs"  # where the rendered script and one log per component go
    # [lo, hi): the ports a job's servers may take on the compute nodes (hi excluded). Each job takes a block of it of
    # its own, chosen from SLURM_JOB_ID, laid out as the stage's ports are (launch/site.py); below slurmd's 6818 and
    # the megatron trainer's MASTER_PORT (20000 + job id mod 20000) by default.
    port_range: list[int] = field(default_factory=lambda: [10000, 20000])
    # where the trainers' run directories (checkpoints, metrics) go: a stage's ckpt_dir defaults to
    # {ckpt_root}/{job_name}. With images it must be under a writable container mount (else the checkpoints live in
    # the container and a requeue starts over); relative paths are relative to the submit directory on bare metal.
    ckpt_root: str = "checkpoints"
    python: str = "python"  # the interpreter the steps run


@dataclass
class ServerSpec:
    """One long-running server step (reward server, judge, critic) in a het group.

    ``command`` may use ``{port}``, ``{health_port}``, each key of ``ports`` (``{grpc_port}``), ``{gpus}``,
    ``{served_model_name}`` (vLLM's ``--served-model-name``: the model name the reward config asks for on the keys
    this server serves), ``{ckpt_dir}``, ``{preset}`` and every ``params`` key of the stage. Its ports are the
    stage's shifted per job (``launch.site``): a command names them by placeholder, never as numbers.
    """

    name: str = "server"  # the server's name: its log file and its $<NAME>_URL / _HOST / _NODE variables
    command: str = ""  # the command the step runs
    port: int = 5555  # where it listens
    health_port: int | None = None  # where health_path is served, if not on `port` (our reward server: health_port)
    # every other port it listens on, by the placeholder its command passes it with (`nemo-factuality serve`:
    # {grpc_port: 5556, triton_metrics_port: 5557, metrics_port: 5559}); shifted per job like `port`
    ports: dict[str, int] = field(default_factory=dict)
    health_path: str = "/health"  # GET path that answers once it is ready
    ready_deadline_s: int = 900  # fail the job when it is not ready after this long
    nodes: int = 1  # the critic only: its Megatron ranks span nodes; every other server is one task on one node
    gpus: int = 0  # GPUs of its node this server gets (CUDA_VISIBLE_DEVICES is split between a node's servers)
    # host memory (GiB) it needs on its node (the critic: on each of its nodes), summed per node into its group's
    # --mem; null = the stage's cpu_server_mem_gb for a server without GPUs, unknown for one with GPUs (its group
    # then asks the profile's `mem`: a vLLM judge's host memory follows its model, which the launcher cannot see)
    mem_gb: float | None = None
    image: str = "trainer"  # which of the profile's images runs it (vLLM lives in `judge`)
    # Reward-config blocks this server answers, e.g. [reward.judge, reward.pipeline.extractor.judge]: the launcher
    # points each block's base_url (OpenAI judges: http://host:port/v1) or url (a served general RM) at this
    # server, in the command of every reward server (`nemo-factuality serve`) whose config has the block.
    serves: list[str] = field(default_factory=list)


@dataclass
class LaunchConfig:
    """``conf/launch/<stage>.yaml``: the het-job topology of one training stage."""

    job_name: str = "factuality"  # Slurm job name; also names the checkpoint directory
    # Site-specific values the commands use as {key}: the policy, the training data, each judge's checkpoint.
    # A null value is required: rendering stops until it is set (`params.policy_model=/models/...`).
    params: dict[str, str | None] = field(default_factory=dict)
    # group 0: the policy actor (trainer). An aligner- or megatron-backend stage names a model preset
    # (conf/train/<trainer.backend>/<preset>.yaml, the backend its trainer command names): the job then takes its
    # nodes, TP and PP from the preset and starts one trainer task per GPU (Megatron ranks; on megatron fewer when
    # the preset's vLLM engines have GPUs of their own), and the trainer command passes `--preset {preset}` so the
    # trainer takes the same layout. Without a preset (hf backend): one process on one node and (on a GPU profile)
    # one GPU.
    preset: str | None = None
    # lay the preset's trainer GPUs out on the profile's nodes when they have another number of GPUs than the preset's
    # (megatron backend): TP, PP and the trainer's GPU count (so DP and the preset's memory arithmetic) kept, nodes and
    # tasks per node derived. An aligner preset cannot: NeMo's trainer takes devices and num_nodes from it.
    fit_nodes: bool = False
    actor_nodes: int | None = None  # None: the preset's nodes, else 1
    tensor_parallel: int | None = None  # None: the preset's TP, else 1
    pipeline_parallel: int | None = None  # None: the preset's PP, else 1
    trainer_command: str = "python -m nemo_factuality.launch.standins trainer --ckpt-dir {ckpt_dir} --steps 100"  # the trainer's command in het group 0 (may use {ckpt_dir}, {preset}, params)
    # the trainer's run directory (exp_manager.explicit_log_dir); may use {ckpt_root} (the profile's) and {job_name}
    ckpt_dir: str = "{ckpt_root}/{job_name}"
    # group 1: factuality reward server(s); group 2: judges (vLLM, a served general RM; omitted when empty).
    # Servers of a group are packed onto its nodes in order (first fit by GPUs).
    reward_servers: list[ServerSpec] = field(default_factory=list)
    judges: list[ServerSpec] = field(default_factory=list)  # the judge servers (vLLM, a served general RM)
    # its own group (last): NeMo-Aligner's PPO critic server, one task per GPU (`gpus` per node) on `nodes`
    # nodes; its URL reaches the trainer as $<NAME>_URL, like the reward servers'
    critic: ServerSpec | None = None
    # GiB of host memory a server without GPUs needs when it declares no mem_gb (a reward server: `nemo-factuality
    # serve`). Measured: the demo reward server (python, tritonserver and its two python-backend stubs) holds about
    # 0.5 GiB when ready; 16 is that with room for a policy tokenizer, large batches in flight and the judge clients,
    # not a measured production peak (a knowledge store is memory-mapped: page cache, reclaimed at the limit). Set a
    # server's mem_gb from its measured peak (sstat/sacct MaxRSS) instead.
    cpu_server_mem_gb: float = 16
    # a server group's --mem is its busiest node's servers' needs times 1 + this: Slurm kills a step whose memory
    # passes the group's limit, and the declared needs are estimates
    server_mem_headroom: float = 0.25
    # preemption: SIGUSR1 this many seconds before the time limit -> checkpoint -> requeue
    signal_before_end_s: int = 300
    max_restarts: int = 3  # stop requeueing after this many restarts (SLURM_RESTART_COUNT)
    ckpt_grace_s: int = 120  # how long the trainer may take to write its checkpoint after USR1
