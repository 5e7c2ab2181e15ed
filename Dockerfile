# Tandem's services (router, broker, trainer) in one image; SGLang runs from its own image.
# compose.yaml builds it; docs/deploy.md explains the deployment.
#
# Base: plain Python, and torch from PyPI at the version pyproject.toml pins. Why not a CUDA or
# PyTorch base image: the PyPI wheel of torch 2.13.0 for Linux is the CUDA 13.0 build and brings
# its own CUDA runtime, cuDNN and NCCL as pip packages (cuda-toolkit 13.0.3, nvidia-cudnn-cu13,
# nvidia-nccl-cu13), so a CUDA base would carry a second copy of the same libraries, and a
# pytorch/pytorch image would pin torch a second time, in a tag that must then follow
# pyproject.toml by hand. The GPU driver comes from the host through the NVIDIA Container Toolkit
# (it must support CUDA 13.0). Python 3.11 is the version the test suite runs on.
FROM python:3.11-slim-bookworm

# Must equal the torch pin in pyproject.toml (tests/test_compose.py checks it). torch gets its
# own layer, before the project's files are copied, so a code change does not fetch ~3 GB again.
ARG TORCH_VERSION=2.13.0
# The user the services run as; compose passes yours (TANDEM_UID/TANDEM_GID) so the trainer can
# write the ./checkpoints bind mount.
ARG UID=1000
ARG GID=1000

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1

# gcc: Triton compiles a small C launcher the first time a torch.compile'd kernel runs (the
# trainer's fused RoPE and SwiGLU; TANDEM_COMPILE=0 runs them eagerly instead).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/tandem
# The dependencies exactly as pyproject.toml lists them (read from it: no second list here), in
# a layer that only a change of pyproject.toml rebuilds: a code change reinstalls the project
# alone, in seconds, not its ~1 GB of dependencies. The check fails the build when
# pyproject.toml pins another torch than TORCH_VERSION.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && python -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '${TORCH_VERSION}' else f'torch {v} installed, Dockerfile says ${TORCH_VERSION}: make them equal')"
COPY README.md ./
COPY proto proto
COPY services services
COPY tandem tandem
RUN pip install --no-deps .

# A non-root user. /weights (the broker's disk transport), /checkpoints and /models are created
# here so that a fresh named volume mounted there belongs to this user.
RUN groupadd --non-unique --gid "${GID}" tandem \
    && useradd --non-unique --uid "${UID}" --gid "${GID}" --create-home tandem \
    && mkdir -p /weights /checkpoints /models \
    && chown tandem:tandem /weights /checkpoints /models
USER tandem
# The built-in toy model (tandem toy-model, seed 0: ~100k parameters, well under 1 MB) at
# /models/model, the CPU stack's model: compose.cpu.yaml's fresh `models` volume starts as a
# copy of it. compose.yaml bind-mounts your ./models over /models, which hides it.
RUN tandem toy-model --out /models/model
# Models are local directories (./models); never reach for the Hugging Face Hub.
ENV USER=tandem \
    HF_HUB_OFFLINE=1

ENTRYPOINT ["tandem"]
