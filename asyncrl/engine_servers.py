"""How an inference engine server is started: one place for the operator's pod specs, the local
runner, benchmarks and tests. Core, not rollout: the operator renders these commands but must not
import the rollout component (tests/test_import_contract.py).
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
