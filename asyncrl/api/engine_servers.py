"""How an inference engine server is started: one place for the operator's pod specs, the local
runner, benchmarks and tests. Core, not rollout: the operator renders these commands but must not
import the rollout component (tests/packaging/test_import_layers.py).
"""

from __future__ import annotations

VLLM_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""Environment the vLLM server needs: dev mode exposes /pause, /resume and /collective_rpc."""


def vllm_server_command(python: str, model: str, *, host: str, port: int | str, dtype: str,
                        tensor_parallel: int = 1, eager: bool = False, extra: list[str] | tuple[str, ...] = ()
                        ) -> list[str]:
    """The one way we start a vLLM server that the vLLM adapter can drive.

    `--logprobs-mode processed_logprobs` makes vLLM report logprobs after temperature (the
    behaviour policy's); the default reports them before, which is wrong whenever T != 1.
    `--enable-scale-out` turns on vLLM 0.32's token-in/token-out /inference/v1/generate, the route
    whose answers carry the weight version of every token (the adapter generates there).
    """
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel),
           "--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
    if eager:
        cmd.append("--enforce-eager")  # CPU: skip graph capture (starts in ~26 s for 135M)
    return cmd + list(extra)


ENGINE_KEY_VOLUME = "engine-key"
ENGINE_KEY_DIR = "/var/run/secrets/asyncrl/engine"
"""The engine Secret as a volume, mounted into the rollout pod's engine proxy alone: the key is in no
environment variable, argv or log of the engine."""
PROXY_LIVE_PATH = "/asyncrl/live"
PROXY_READY_PATH = "/asyncrl/ready"
"""The engine proxy's own probe paths (asyncrl/rollout/engines/proxy.py), the only ones open without the key."""


def engine_proxy_command(*, port: int, upstream_port: int, api_key_file: str, health_path: str = "/health"
                         ) -> list[str]:
    """The one way we start `asyncrl engine-proxy` in front of an engine listening on loopback."""
    return ["asyncrl", "engine-proxy", "--port", str(port), "--upstream", f"http://127.0.0.1:{upstream_port}",
            "--api-key-file", api_key_file, "--health-path", health_path]
