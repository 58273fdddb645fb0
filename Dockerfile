# syntax=docker/dockerfile:1
# nemo_factuality on one stack: the container runs the versions CI's NeMo-Aligner venv tests
# (requirements/aligner.txt, built by tools/setup_stack_env.sh aligner); tests/test_container_stack.py fails when the
# pins below and that file drift apart.
#   docker build -t nemo_factuality:trainer .                    # the trainer image (the last stage)
#   docker build -t nemo_factuality:judge --target judge .       # the vLLM judge image
#   enroot import -o nemo_factuality_trainer.sqsh dockerd://nemo_factuality:trainer   # for pyxis
#
# The stack, and why:
#   NeMo-Aligner 0.7.0   the last release (archived 2025-05); its imports need NeMo's collections/nlp, which
#                        nemo-toolkit 2.4.1 is the last to ship. It declares only Jinja2 and jsonlines: the rest
#                        of the stack is ours to choose.
#   nemo-toolkit 2.2.1   the NeMo line whose imports Aligner 0.7.0 was checked against (0 of its 34 nemo.* imports
#                        missing) and the one every CPU test runs: actors, fit(), critic server, checkpoints.
#   megatron-core 0.12.3 what NeMo 2.2's nlp models run with in those tests (TP/PP/DP, distributed optimizer,
#                        sequence parallelism, dist checkpointing). It has cp310/cp311 wheels only: on this
#                        image's Python 3.12 pip builds it from the sdist (pybind11 and a compiler are in the base).
#   nvidia-pytriton 0.7.0 the reward/critic servers' Triton; same reward_model protocol as Aligner's 0.5.10.
#   transformers 4.48.3  NeMo 2.2's HF tokenizer/config code predates transformers 5.
#   pangu 4.0.6.1, pyarrow 21.0.0: pangu 6 dropped what NeMo's Chinese tokenizer imports; pyarrow >= 22 needs
#                        numpy >= 2, and nvidia-pytriton needs numpy < 2.
# What the CPU tests proved (README "One stack"): with these versions NeMo-Aligner's actors train at TP=2, PP=2 and
# DP=2 with the presets' GPU settings (bf16 + megatron_amp_O2, Megatron-Core's distributed optimizer, sequence
# parallelism, full recompute, Adam-state offload), resume exactly, and Aligner's own fit() runs against our
# reward server. They did so on torch 2.13 (CPU), Python 3.11.
#   torch line           NGC PyTorch 25.01: torch 2.6.0a0, CUDA 12.8, Python 3.12, with Transformer Engine and Apex
#                        built against that torch. It is the base NeMo 2.2's own install instructions name
#                        (NV_PYTORCH_TAG 25.01) and NeMo 2.2's container (nemo:25.02) uses; the CUDA-built
#                        packages come from the base and are frozen below, so nothing re-installs torch. CI runs
#                        torch 2.13 CPU (no CPU build of the NGC torch exists), and checks on Python 3.12 that the
#                        package compiles and its modules import (tests/test_container_stack.py).
#   judge image          vLLM needs a newer torch than this base: judges run in their own image (--target judge),
#                        vllm/vllm-openai at the version of requirements/vllm.txt (the rollout engine's too).
#   megatron target      the maintained stack (trainer.backend=megatron, requirements/megatron.txt): megatron-core
#                        0.16.1 + megatron-bridge 0.3.1 on NGC PyTorch 25.11 — a current NGC release whose torch meets
#                        Bridge's >= 2.6 and which ships Transformer Engine built against that torch, so Megatron-Core
#                        builds TE's layer spec (the CPU tests stub TE). The same --no-deps closed set as CI's megatron
#                        venv (Bridge's metadata hard-requires CUDA-only builds the GPT path never imports), base CUDA
#                        packages frozen as in the trainer stage; tests/test_container_stack.py fails when the pins and
#                        requirements/megatron.txt drift. It also carries the rollout engine: official vLLM (the
#                        judges' version) in its own venv, /opt/vllm, because vLLM pins its own torch.
#     docker build -t nemo_factuality:megatron --target megatron .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
ARG MEGATRON_BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---------------------------------------------------------------------------------------- judges (vLLM)
FROM ${VLLM_IMAGE} AS judge
WORKDIR /workspace

# ---------------------------------------------------------------------------------------- megatron (maintained stack)
FROM ${MEGATRON_BASE_IMAGE} AS megatron
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace/nemo_factuality
RUN python -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" \
 && python -c "import torch, transformer_engine.pytorch; print('torch', torch.__version__)" \
 && pip list --format=freeze | grep -iE '^(torch|torchvision|triton|pytorch-triton|transformer.engine|apex|flash.attn|numpy)==' \
    > /opt/base-constraints.txt
# The pins of requirements/megatron.txt that the base does not provide (torch, numpy and the like are the base's).
RUN pip install --no-cache-dir --no-deps \
    "megatron-core==0.16.1" \
    "megatron-bridge==0.3.1" \
    "transformers==4.57.6" \
    "einops==0.8.2" \
    "omegaconf==2.3.0" \
    "antlr4-python3-runtime==4.9.3" \
    "huggingface-hub==0.36.2" \
    "tokenizers==0.22.2" \
    "safetensors==0.8.0" \
 && python -c "import megatron.core, megatron.bridge; print('megatron-core', megatron.core.__version__)"
# The rollout engine's own interpreter (rollout.engine=vllm): vLLM pins its own torch, so it never shares this one.
RUN python -m venv /opt/vllm \
 && /opt/vllm/bin/pip install --no-cache-dir \
    "vllm==0.32.0" \
 && /opt/vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
ENV NEMO_FACTUALITY_VLLM_PYTHON=/opt/vllm/bin/python
COPY pyproject.toml README.md LICENSE ./
COPY nemo_factuality ./nemo_factuality
COPY conf ./conf
COPY slurm ./slurm
COPY tools ./tools
RUN pip freeze | grep -iE '^(megatron-core|megatron-bridge|transformers|tokenizers|huggingface-hub)==' \
    >> /opt/base-constraints.txt \
 && pip install --no-cache-dir -c /opt/base-constraints.txt -e ".[serve,train,retrieval]" \
 && python -c "import nemo_factuality.trainers.backends.megatron.actor, nemo_factuality.trainers.engines.vllm_engine"
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

# ---------------------------------------------------------------------------------------- trainer (default)
FROM ${BASE_IMAGE} AS trainer
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace/nemo_factuality

# The base must carry the CUDA builds nothing below installs; fail here rather than in a job.
RUN python -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" \
 && python -c "import torch, transformer_engine.pytorch, apex, amp_C; print('torch', torch.__version__)" \
 && pip list --format=freeze | grep -iE '^(torch|torchvision|triton|pytorch-triton|transformer.engine|apex|flash.attn|numpy)==' \
    > /opt/base-constraints.txt

# The NeMo-Aligner stack (the pins of requirements/aligner.txt), never replacing the base's CUDA builds.
RUN pip install --no-cache-dir -c /opt/base-constraints.txt \
    "nemo-toolkit[nlp]==2.2.1" \
    "nemo-aligner==0.7.0" \
    "megatron-core==0.12.3" \
    "nvidia-pytriton==0.7.0" \
    "transformers==4.48.3" \
    "lightning==2.4.0" \
    "pangu==4.0.6.1" \
    "pyarrow==21.0.0" \
    "psutil>=5.9" \
 && python -c "import nemo, nemo_aligner, megatron.core, pytriton; print('nemo', nemo.__version__)"

# This package and its own light dependencies, again without touching the stack above.
COPY pyproject.toml README.md LICENSE ./
COPY nemo_factuality ./nemo_factuality
COPY conf ./conf
COPY slurm ./slurm
COPY tools ./tools
RUN pip freeze | grep -iE '^(nemo-toolkit|nemo.aligner|megatron-core|nvidia-pytriton|transformers|lightning|pangu|pyarrow)==' \
    >> /opt/base-constraints.txt \
 && pip install --no-cache-dir -c /opt/base-constraints.txt -e ".[serve,megatron,train,retrieval]" \
 && python -c "import nemo_factuality.trainers.backends.aligner.actor, nemo_factuality.serving.server"
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
