# The trainer: PyTorch (CUDA) + asyncrl. The operator runs it under torchrun:
#   torchrun ... -m asyncrl.cli trainer --config /etc/asyncrl/job.yaml
# torch comes from the pinned base image; never let pip resolve an unpinned torch here.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
# The experiment trackers (spec.logging: TensorBoard, W&B, MLflow client) come with the image (~235 MB):
# a job cannot add a package to a running pod, and a configured tracker without one fails the job.
RUN pip install ".[trainer,trackers]" && rm -rf /src

RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl || true
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 29500
ENTRYPOINT ["asyncrl"]
CMD ["trainer", "--config", "/etc/asyncrl/job.yaml"]
