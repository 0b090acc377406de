# syntax=docker/dockerfile:1
# The asyncrl operator: kopf + the kubernetes client, no torch. Build from the repo root:
#   bash scripts/build-images.sh operator            (podman or docker, whichever is present)
#   docker build -f images/operator.Dockerfile -t ghcr.io/asyncrl/operator:0.1.0 .
# Three stages. `python` is the base plus Debian's Python 3.11 (bookworm's python3: the CPython
# minor the locks and the test suite use). `build` makes the venv /opt/asyncrl from
# requirements/operator.lock alone (pip --require-hashes: every version pinned, every file's sha256
# checked) plus asyncrl's own wheel, built offline from this checkout; the final stage is `python`
# plus that venv, nothing else (no build tools, no pip cache, no sources). scripts/lock.sh
# regenerates the locks.

# Base: debian:bookworm-slim, pinned by its multi-platform index digest. Digest source: public
# Dockerfiles pinning this tag (two independent GitHub repositories give this same digest); it was
# not re-read from Docker Hub here. To move it: `docker buildx imagetools inspect debian:bookworm-slim`,
# its "Digest:" below. Where no registry is reachable, scripts/build-images.sh --local-base makes the
# same Debian release from the package mirror (mmdebstrap) and passes it as BASE.
ARG BASE=debian:bookworm-slim@sha256:7b140f374b289a7c2befc338f42ebe6441b7ea838a042bbd5acbfca6ec875818

FROM ${BASE} AS python
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM python AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/*
# The CA bundle pip trusts (a build argument, so no final image keeps it): a TLS-intercepting proxy's
# bundle where there is one (scripts/build-images.sh ASYNCRL_BUILD_CA), else the base's own.
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/operator.lock requirements/build.lock requirements/
RUN python3 -m venv /opt/asyncrl \
 && /opt/asyncrl/bin/pip install --require-hashes -r requirements/operator.lock
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
# asyncrl's wheel, built by the locked setuptools in a throwaway venv (--no-build-isolation --no-index:
# nothing fetched), then installed with --no-index: that also fails if the lock lacks any of
# asyncrl[operator]'s requirements.
RUN python3 -m venv /tmp/build \
 && /tmp/build/bin/pip install --require-hashes -r requirements/build.lock \
 && /tmp/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/wheels . \
 && /opt/asyncrl/bin/pip install --no-index --find-links /tmp/wheels "asyncrl[operator]"

FROM python
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/asyncrl/bin:$PATH
COPY --from=build /opt/asyncrl /opt/asyncrl
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["asyncrl"]
CMD ["operator"]
