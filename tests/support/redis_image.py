"""The redis image's commands on this machine: `redis-server` and `redis-cli` as the valkey binaries
the project uses, in one folder to put first on a PATH."""

from __future__ import annotations

from pathlib import Path

from asyncrl.local.redis_server import find_server_binary


def redis_bin_dir(root: Path) -> Path:
    """`root`/redis-image-bin with `redis-server` and `redis-cli` linked to the valkey binaries."""
    server = find_server_binary()
    out = root / "redis-image-bin"
    out.mkdir(parents=True, exist_ok=True)
    for name, target in (("redis-server", server), ("redis-cli", server.with_name(
            server.name.replace("server", "cli")))):
        assert target.exists(), f"{target} missing: the Redis pod needs it"
        if not (out / name).exists():
            (out / name).symlink_to(target)
    return out
