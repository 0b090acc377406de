# syntax=docker/dockerfile:1
# The trainer: PyTorch (CUDA) + asyncrl. The operator runs it under torchrun:
#   torchrun ... -m asyncrl.cli trainer --config /etc/asyncrl/job.yaml
# torch comes from the pinned base image; never let pip resolve an unpinned torch here.
# Two stages. `build` makes the venv /opt/asyncrl from requirements/trainer.lock alone (pip
# --require-hashes: every version pinned, every file's sha256 checked) plus asyncrl's own wheel, built
# offline from this checkout; the final stage is the same base plus that venv, nothing else (no build
# tools, no pip cache, no sources). scripts/lock.sh regenerates the locks.

# Base (both stages: the venv links to the base's interpreter and uses its torch):
# pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime (Python 3.11, torch 2.7.1 = requirements/trainer-base.in),
# pinned by digest. Digest source: public Dockerfiles and build records pinning this tag (several
# independent GitHub repositories give this same digest, one noting the registry's manifest was
# rechecked); it was not re-read from Docker Hub here. To move it: `docker buildx imagetools inspect
# pytorch/pytorch:<tag>`, its tag and "Digest:" into both FROM lines, its torch version into
# requirements/trainer-base.in, then `bash scripts/lock.sh`.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime@sha256:2b59b1b91885677814f78be1f8df48a25d5dc952eb6580eaecfefca510f9afd3 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/trainer.lock requirements/build.lock requirements/
# A venv over the base's Python that sees its torch (--system-site-packages). The lock holds everything
# else, resolved against torch 2.7.1 (it leaves out torch and what only torch needs), and pip's resolver
# checks that the base's torch meets it. The experiment trackers (spec.logging: TensorBoard, W&B, MLflow
# client) come with the image (~235 MB): a job cannot add a package to a running pod, and a configured
# tracker without one fails the job.
RUN python -m venv --system-site-packages /opt/asyncrl \
 && /opt/asyncrl/bin/pip install --require-hashes -r requirements/trainer.lock
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
# asyncrl's wheel, built by the locked setuptools in a throwaway venv (--no-build-isolation --no-index:
# nothing fetched), then installed with --no-index: that also fails if the lock and the base lack any of
# asyncrl[trainer,trackers]'s requirements. torchrun starts its workers with its own interpreter, so
# the venv gets a torchrun of its own (the base's runs the base's Python, which cannot see asyncrl).
RUN python -m venv /tmp/build \
 && /tmp/build/bin/pip install --require-hashes -r requirements/build.lock \
 && /tmp/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/wheels . \
 && /opt/asyncrl/bin/pip install --no-index --find-links /tmp/wheels "asyncrl[trainer,trackers]" \
 && printf '#!/opt/asyncrl/bin/python\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' \
      > /opt/asyncrl/bin/torchrun \
 && chmod 0755 /opt/asyncrl/bin/torchrun

FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime@sha256:2b59b1b91885677814f78be1f8df48a25d5dc952eb6580eaecfefca510f9afd3
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp PATH=/opt/asyncrl/bin:$PATH
COPY --from=build /opt/asyncrl /opt/asyncrl
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl || true
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 29500
ENTRYPOINT ["asyncrl"]
CMD ["trainer", "--config", "/etc/asyncrl/job.yaml"]
