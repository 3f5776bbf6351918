# The Seawall image the manifests in deploy/kubernetes run (ghcr.io/seawall/seawall:<version>).
#   docker build -t ghcr.io/seawall/seawall:0.1.0 .
# Slim and non-root; the base image by version and every Python dependency pinned
# (deploy/docker/requirements.txt). Pin the base by digest too where your registry
# allows: --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/seawall
COPY deploy/docker/requirements.txt /tmp/requirements.txt
RUN /opt/seawall/bin/pip install --no-deps -r /tmp/requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/seawall/bin/pip install --no-deps . \
    && /opt/seawall/bin/seawall --help > /dev/null

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/seawall/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 seawall \
    && useradd --system --no-log-init --uid 10001 --gid seawall --no-create-home \
       --shell /usr/sbin/nologin seawall
COPY --from=build /opt/seawall /opt/seawall
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["seawall"]
CMD ["serve", "--config", "/etc/seawall/gateway.yaml"]
