# The image every node and pod of a cluster from `python -m cluster.render` runs: Ray's own CUDA image of the Ray
# version this project pins, with vitscale's dependencies installed as `make setup` installs them. The code itself
# is not installed: each job brings it as Ray's working_dir (your checkout, from `make launch`), and a KubeRay
# RayJob ships the copy kept here in /home/ray/vitscale. tests/cluster/test_render.py holds the torch pin, the
# DeepSpeed install and the base image equal to the Makefile's and cluster/render.py's.
#
#   docker build -t registry.example.com/vitscale:ray2.60.0 .     # your registry in place of registry.example.com
#   docker push registry.example.com/vitscale:ray2.60.0
#   python -m cluster.render --cluster a100x64 --image registry.example.com/vitscale:ray2.60.0 ...
ARG RAY_VERSION=2.60.0
FROM rayproject/ray:${RAY_VERSION}-py311-gpu

ARG TORCH_VERSION=2.13.0
# torch first, so DeepSpeed builds against it and no later install swaps it (the Makefile's order).
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
# Without its ops (built on first use) and against the torch above rather than an isolated build's own.
RUN DS_BUILD_OPS=0 pip install --no-cache-dir "deepspeed>=0.16,<0.20" --no-build-isolation
# EFA's user space for NCCL between nodes (`network.kind: efa`, docs/network.md "EFA in the container"): libfabric and
# the aws-ofi-nccl plugin, without the kernel module (the host's). Where NCCL cannot load the plugin it trains over TCP
# sockets without an error; a worker of such a profile refuses to start instead (cluster.network.efa_missing).
# Pinned, with the checksum AWS publishes for it, so two builds install the same plugin; another version: pass both.
ARG EFA_INSTALLER_VERSION=1.41.0
ARG EFA_INSTALLER_SHA256=3506354cdfbe31ff552fe75f5d0d9bb7efd29cf79bd99457347d29c751c38f9f
RUN cd /tmp && sudo apt-get update \
    && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
    && echo "${EFA_INSTALLER_SHA256}  aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | sha256sum -c - \
    && tar xzf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" && cd aws-efa-installer && sudo ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
    && cd /tmp && sudo rm -rf aws-efa-installer* /var/lib/apt/lists/*
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}

WORKDIR /home/ray/vitscale
COPY --chown=ray:users pyproject.toml README.md .gitignore constraints-dev.txt ./
COPY --chown=ray:users pretrain pretrain
COPY --chown=ray:users data_pipeline data_pipeline
COPY --chown=ray:users evals evals
COPY --chown=ray:users cluster cluster
COPY --chown=ray:users tracking tracking
COPY --chown=ray:users bench bench
COPY --chown=ray:users configs configs
# The dependencies, with the extra the GPU profiles' shards need (s3://); a job's runtime env adds any other. With
# `make setup`'s constraints (README.md, "Install"): without them pip backtracks through the object-storage stack.
# Then vitscale itself goes again, so the job's working_dir is the only vitscale a process imports.
RUN pip install --no-cache-dir ".[s3]" -c constraints-dev.txt \
    && pip uninstall -y vitscale \
    && rm -rf build ./*.egg-info
