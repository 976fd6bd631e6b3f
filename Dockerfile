# embedpool HTTP API on CPU: `docker compose up` (or `docker build -t embedpool .`).
# The default model (all-MiniLM-L6-v2) comes inside its PyPI package; nothing is downloaded at
# run time. Collections live in the /data volume.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# CPU-only torch wheels (a plain `pip install torch` on Linux pulls the CUDA build)
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY embedpool ./embedpool
COPY app ./app
COPY poolers ./poolers
COPY index ./index
RUN pip install --no-cache-dir . \
    && python -c "from embedpool.poolers.encoder import default_model_path; print('model at', default_model_path())"

FROM ${PYTHON_IMAGE}
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
