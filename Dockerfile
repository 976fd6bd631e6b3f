# embedpool HTTP API on CPU: `docker compose up` (or `docker build -t embedpool .`).
# The default model (all-MiniLM-L6-v2) comes inside its PyPI package; nothing is downloaded at
# run time. Collections live in the /data volume.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Both stages carry this label so that deploy/podman-image.sh can remove, after a build, the images
# it leaves untagged (this build stage, an image the new one replaced) and nothing else.
LABEL io.embedpool.part=build
# CPU-only torch wheels (a plain `pip install torch` on Linux pulls the CUDA build). TORCH_WHEELS
# names a folder holding the CPU wheel, mounted into the build, to use instead of that index
# (`make image` does this where the index is not reachable; torch's own dependencies still come
# from the package index).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# hadolint ignore=SC2086,DL3013
RUN if [ -n "${TORCH_WHEELS}" ]; then src="--find-links ${TORCH_WHEELS}"; \
    else src="--index-url ${TORCH_INDEX}"; fi \
    && pip install --no-cache-dir $src "torch==${TORCH_VERSION}"
# A C compiler for the project's one compiled part (index/_amxscan.c, the MaxSim scans fused on
# AMX tiles and AVX-512 VNNI, built by setup.py), and Python's headers where the base image lacks them (the
# official python images ship them; a Debian python3.11 needs python3.11-dev). Build stage
# only: the runtime stage gets the built module with /opt/venv, not the compiler.
# hadolint ignore=DL3008,SC2086
RUN headers="$(python -c 'import os, sysconfig; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3.11-dev")')" \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev ${headers} \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY embedpool ./embedpool
COPY app ./app
COPY poolers ./poolers
COPY index ./index
# optional parts (pyproject's extras): none for the API image; `ray` for the Ray nodes' image
ARG EXTRAS=
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".${EXTRAS:+[${EXTRAS}]}"
# What the API never loads goes (the build stage's layers are not shipped, only /opt/venv):
# torch's C++ headers, test binaries and tools but its shared-memory manager (no torch.compile or
# extension builds here), OpenVINO's GPU/NPU plugins (a CPU image), the packages' own test
# folders, and the bytecode pip compiled for every module (330 MB, most never imported). Then
# one real embedding compiles the bytecode of the modules the service does import (the image's
# user cannot write /opt/venv, so this keeps start-up as fast as with pip's compile). The
# checks run outside /src, where the source folder embedpool/ would shadow the installed package.
WORKDIR /
RUN site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "${site}/torch/include" "${site}/torch/test" \
    && find "${site}/torch/bin" -mindepth 1 -not -name torch_shm_manager -delete \
    && rm -f "${site}/openvino/libs/libopenvino_intel_gpu_plugin.so" "${site}/openvino/libs/libopenvino_intel_npu_plugin.so" \
    && find "${site}" -depth -type d \( -name tests -o -name test \) -not -path "${site}/torch/*" -exec rm -rf {} + \
    && find /opt/venv -depth -type d -name __pycache__ -exec rm -rf {} + \
    && python -c "from embedpool.poolers.encoder import default_model_path; print('model at', default_model_path())" \
    && python -c "import embedpool.app.server.app, embedpool.index.faiss, embedpool.index.kernels" \
    && python -c "from embedpool.index import amxscan; assert amxscan.built(), 'the fused MaxSim scans were not built'" \
    && embedpool embed "The image compiles what it imports." > /dev/null

FROM ${PYTHON_IMAGE}
LABEL io.embedpool.part=image
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    OMP_WAIT_POLICY=PASSIVE \
    EMBEDPOOL_HOST=0.0.0.0 \
    EMBEDPOOL_PORT=8000 \
    EMBEDPOOL_DATA_DIR=/data
RUN groupadd --system --gid 10001 embedpool \
    && useradd --system --uid 10001 --gid embedpool --home-dir /home/embedpool --create-home embedpool \
    && mkdir -p /data \
    && chown embedpool:embedpool /data
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/embedpool
VOLUME ["/data"]
EXPOSE 8000
# 200 once the model is loaded (loading takes ~20 s on 2 cores)
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('EMBEDPOOL_PORT', '8000'), timeout=4)"]
CMD ["embedpool", "serve"]
