# xinserve on CPU: `docker build -t xinserve . && docker run -p 8000:8000 xinserve`
# serves the embedded tiny model (built on first start into /cache; nothing is downloaded).
# Mount a config and models to serve real ones:
#   docker run -p 8000:8000 -v ./my.yaml:/etc/xinserve/config.yaml -v /data/models:/data/models \
#     xinserve serve --config /etc/xinserve/config.yaml
# Ascend and MUSA hosts build on their vendor's base image instead (torch_npu / torch_musa inside):
#   docker build --build-arg BASE_IMAGE=<vendor image> --build-arg TORCH_SPEC= -t xinserve:npu .
# Prefill/decode disaggregation (docs/disaggregation.md) needs Mooncake's transfer engine and its libraries:
#   docker build --build-arg WITH_MOONCAKE=1 -t xinserve:cpu-pd .
# Warm at build time (docs/operations.md#warm-caches-which-to-pick-when): WARMUP=1 runs `xinserve warmup`
# for config/default.yaml, so the image carries the embedded model, the C++ kernels and the compiled
# decode buckets in /cache and serves at full speed from its first request. Build it on the CPU kind
# that serves it (the C++ kernels are compiled with -march=native; elsewhere they build again):
#   docker build --build-arg WARMUP=1 -t xinserve:cpu-warm .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Empty on vendor images, whose torch must not be replaced.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    XINSERVE_CACHE_DIR=/cache

WORKDIR /app
# A C++ compiler: the C++ CPU kernels (below) and inductor's compiled decode buckets are built with it.
RUN command -v g++ >/dev/null || (apt-get update && apt-get install -y --no-install-recommends g++ \
      && rm -rf /var/lib/apt/lists/*)
# torch first, so code changes do not reinstall it.
RUN if [ -n "$TORCH_SPEC" ]; then pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"; fi
# Every other version from the lock the test suite passed with (make lock); the folders install as
# xinserve.server, xinserve.engines, xinserve.kernels, xinserve.config (setup.py).
COPY pyproject.toml setup.py README.md requirements.lock ./
COPY server ./server
COPY engines ./engines
COPY kernels ./kernels
COPY config ./config
ARG WITH_MOONCAKE=""
RUN if [ -n "$WITH_MOONCAKE" ]; then apt-get update \
      && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
      && rm -rf /var/lib/apt/lists/*; fi
RUN pip install -c requirements.lock ".${WITH_MOONCAKE:+[mooncake]}" \
    && useradd --create-home --uid 1000 xinserve \
    && mkdir -p /cache && chown xinserve /cache
# The C++ CPU kernels, built into the image's Python environment (kernels/cpu/cpp_build.py --install; for
# this build machine's CPU flags: another CPU builds them into /cache on first start).
RUN python -m xinserve.kernels.cpu.cpp_build --install

USER xinserve
# Before VOLUME: what a RUN writes into a declared volume is thrown away. A new named volume mounted at
# /cache starts as a copy of what is here (docker-compose.yml's xinserve-cache).
ARG WARMUP=""
RUN if [ -n "$WARMUP" ]; then xinserve warmup --config /app/config/default.yaml; fi
VOLUME ["/cache"]
EXPOSE 8000
# `xinserve serve` alone serves config/default.yaml, installed with the package (xinserve.config).
ENTRYPOINT ["xinserve"]
CMD ["serve"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
