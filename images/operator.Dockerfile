# The asyncrl operator: kopf + the kubernetes client, no torch. Build from the repo root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/asyncrl/operator:0.1.0 .
FROM python:3.12.8-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
RUN pip install ".[operator]" && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["asyncrl"]
CMD ["operator"]
