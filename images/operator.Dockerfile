# syntax=docker/dockerfile:1
# The asyncrl operator: kopf + the kubernetes client, no torch. Build from the repo root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/asyncrl/operator:0.1.0 .
# Two stages. `build` makes the venv /opt/asyncrl from requirements/operator.lock alone (pip
# --require-hashes: every version pinned, every file's sha256 checked) plus asyncrl's own wheel, built
# offline from this checkout; the final stage is the same base plus that venv, nothing else (no build
# tools, no pip cache, no sources). scripts/lock.sh regenerates the locks.

# Base (both stages: the venv links to the base's interpreter): python:3.12.15-slim-bookworm, pinned by
# its multi-platform index digest. Digest source: public Dockerfiles pinning this tag (several
# independent GitHub repositories, one recording it as the Docker Official Image's index digest observed
# on 2026-10-03); it was not re-read from Docker Hub here. To move it: `docker buildx imagetools inspect
# python:3.12-slim-bookworm` (or the newer patch tag), then its tag and "Digest:" into both FROM lines.
FROM python:3.12.15-slim-bookworm@sha256:54c85f3c47607a77f32adec749d3c81d1348bf25833671f512b26a9b6d778cb3 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/operator.lock requirements/build.lock requirements/
RUN python -m venv /opt/asyncrl \
 && /opt/asyncrl/bin/pip install --require-hashes -r requirements/operator.lock
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
# asyncrl's wheel, built by the locked setuptools in a throwaway venv (--no-build-isolation --no-index:
# nothing fetched), then installed with --no-index: that also fails if the lock lacks any of
# asyncrl[operator]'s requirements.
RUN python -m venv /tmp/build \
 && /tmp/build/bin/pip install --require-hashes -r requirements/build.lock \
 && /tmp/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/wheels . \
 && /opt/asyncrl/bin/pip install --no-index --find-links /tmp/wheels "asyncrl[operator]"

FROM python:3.12.15-slim-bookworm@sha256:54c85f3c47607a77f32adec749d3c81d1348bf25833671f512b26a9b6d778cb3
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/asyncrl/bin:$PATH
COPY --from=build /opt/asyncrl /opt/asyncrl
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["asyncrl"]
CMD ["operator"]
