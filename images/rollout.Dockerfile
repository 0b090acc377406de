# syntax=docker/dockerfile:1
# The rollout image: a pinned SGLang server image plus asyncrl, so one image runs the engine
# container (`python3 -m sglang.launch_server ...` or `asyncrl engine`) and the worker container
# (`asyncrl rollout --config /etc/asyncrl/job.yaml`). SGLang already brings torch and transformers.
# Two stages. `build` makes the venv /opt/asyncrl from requirements/rollout.lock alone (pip
# --require-hashes: every version pinned, every file's sha256 checked) plus asyncrl's own wheel, built
# offline from this checkout; the final stage is the same base plus that venv, nothing else (no build
# tools, no pip cache, no sources). scripts/lock.sh regenerates the locks.

# Base (both stages: the venv links to the base's interpreter and uses SGLang's packages):
# lmsysorg/sglang:v0.5.10.post1-cu126, SGLang 0.5.10.post1 = rollout/engines/sglang.py PINNED_VERSION =
# requirements/rollout-base.in, and RolloutSpec's default engine image. BY TAG ONLY: no public source
# we could cite gives this tag's digest, so it is the one known exception in tests/packaging/test_images.py.
# To pin it: `docker buildx imagetools inspect lmsysorg/sglang:v0.5.10.post1-cu126`, then append
# `@sha256:<its "Digest:">` to both FROM lines and to RolloutSpec.image's default, and drop the exception.
FROM lmsysorg/sglang:v0.5.10.post1-cu126 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/rollout.lock requirements/build.lock requirements/
# A venv over SGLang's Python that sees its packages (--system-site-packages). The lock holds only what
# SGLang lacks (it leaves out SGLang and everything SGLang requires), so none of the engine's packages
# is replaced, and pip's resolver checks that the base meets the rest.
RUN python3 -m venv --system-site-packages /opt/asyncrl \
 && /opt/asyncrl/bin/pip install --require-hashes -r requirements/rollout.lock
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY operator ./operator
COPY trainer ./trainer
COPY rollout ./rollout
# asyncrl's wheel, built by the locked setuptools in a throwaway venv (--no-build-isolation --no-index:
# nothing fetched), then installed with --no-index: that also fails if the lock and the base lack any of
# asyncrl[rollout]'s requirements.
RUN python3 -m venv /tmp/build \
 && /tmp/build/bin/pip install --require-hashes -r requirements/build.lock \
 && /tmp/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/wheels . \
 && /opt/asyncrl/bin/pip install --no-index --find-links /tmp/wheels "asyncrl[rollout]"

FROM lmsysorg/sglang:v0.5.10.post1-cu126
# The venv's bin goes last on PATH: `asyncrl` is found there, while `python3` stays the image's own, so
# the engine container runs SGLang exactly as the base ships it.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp PATH=$PATH:/opt/asyncrl/bin
COPY --from=build /opt/asyncrl /opt/asyncrl
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin asyncrl || true
USER 1000:1000
WORKDIR /tmp
EXPOSE 30000
ENTRYPOINT ["asyncrl"]
CMD ["rollout", "--config", "/etc/asyncrl/job.yaml"]
