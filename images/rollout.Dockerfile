# The rollout image: a pinned SGLang server image plus asyncrl, so one image runs the engine
# container (`python3 -m sglang.launch_server ...` or `asyncrl engine`) and the worker container
# (`asyncrl rollout --config /etc/asyncrl/job.yaml`). SGLang already brings torch and transformers.
FROM lmsysorg/sglang:v0.5.10.post1-cu126

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
# --no-deps for torch-bearing extras: keep SGLang's pinned torch/transformers; add only what is missing.
RUN pip install --no-deps . \
 && pip install "pydantic>=2.7,<3" "pyyaml>=6" "kubernetes>=30" "redis>=5.0" "msgpack>=1.0" "rich>=13" \
        "httpx>=0.27" "math-verify>=0.7" "pyarrow>=15" \
 && rm -rf /src

RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl || true
USER 1000:1000
WORKDIR /tmp
EXPOSE 30000
ENTRYPOINT ["asyncrl"]
CMD ["rollout", "--config", "/etc/asyncrl/job.yaml"]
