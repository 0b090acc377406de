import redis


def test_local_redis_serves_streams_and_survives_restart_with_aof(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.xadd("s", {"k": "v"})
    r.execute_command("CONFIG", "SET", "appendfsync", "always")
    r.xadd("s", {"k": "w"})
    redis_server.stop(kill=True)
    redis_server.start()
    r = redis.Redis.from_url(redis_server.url)
    assert r.xlen("s") == 2


def test_local_redis_with_password(tmp_path):
    from asyncrl.local.redis_server import LocalRedis

    with LocalRedis(tmp_path / "r", password="s3cret") as server:
        assert redis.Redis.from_url(server.url).ping()
