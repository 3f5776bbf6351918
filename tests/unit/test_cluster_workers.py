"""What `seawall serve --workers` hands each worker: the parent's flags, and the few
settings that make N processes one fleet on one port (the processes themselves run in
tests/integration/test_cluster_workers.py)."""

from __future__ import annotations

import argparse

import pytest

from seawall.config import parse_config
from seawall.gateway import serve_cli
from seawall.gateway.workers import WorkerSpec, instance_base, public_admin_url, worker_argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return p


def test_a_worker_gets_every_flag_of_the_parent_but_workers() -> None:
    argv = [
        "--config", "gw.yaml", "--workers", "4", "--replica", "http://a:1", "--replica",
        "http://b:2", "--host", "0.0.0.0", "--port", "8080", "--ttft-timeout", "2.5",
        "--itl-timeout", "1", "--total-timeout", "90", "--no-access-log", "--log-level",
        "WARNING", "--log-format", "json", "--watch-config", "3",
    ]  # fmt: skip
    parser = _parser()
    args = parser.parse_args(argv)
    rebuilt = worker_argv(parser, args)
    assert "--workers" not in rebuilt
    again = vars(parser.parse_args(rebuilt))
    assert again == {**vars(args), "workers": None}
    # Every option the parser knows is covered (a new flag is passed on by itself).
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "workers"}
    assert dests <= set(again)
    # Nothing given, nothing passed.
    assert worker_argv(parser, parser.parse_args(["--workers", "2"])) == []


def test_the_worker_config_shares_the_port_and_the_store_and_keeps_the_rest() -> None:
    config = parse_config(
        {
            "listen": {"host": "0.0.0.0", "port": 0},
            "replicas": [{"url": "http://127.0.0.1:9", "model": "m"}],
            "admin": {"enabled": True, "host": "0.0.0.0", "port": 8081, "token_hash": "sha256:00"},
            "drain": {"timeout_s": 7},
        }
    )
    spec = WorkerSpec(1, "host-w1", 45000, "/tmp/s/cluster.sock", "http://10.0.0.5:8081")
    assert WorkerSpec.from_env({"SEAWALL_WORKER": spec.to_env()}) == spec
    assert WorkerSpec.from_env({}) is None
    mine = spec.apply(config)
    assert (mine.listen.host, mine.listen.port) == ("0.0.0.0", 45000)
    assert (mine.admin.host, mine.admin.port) == ("127.0.0.1", 0)  # private; the parent relays
    assert mine.admin.token_hash == config.admin.token_hash
    cc = mine.cluster
    assert (cc.store, cc.local_socket, cc.instance_id) == (
        "local",
        "/tmp/s/cluster.sock",
        "host-w1",
    )
    assert cc.advertise_admin_url == "http://10.0.0.5:8081"
    assert mine.drain == config.drain and mine.replicas == config.replicas


def test_with_redis_the_worker_keeps_the_store_and_the_advertised_address() -> None:
    config = parse_config(
        {
            "replicas": [{"url": "http://127.0.0.1:9", "model": "m"}],
            "cluster": {
                "store": "redis",
                "redis_url": "redis://r:6379/0",
                "instance_id": "pod-a",
                "advertise_admin_url": "http://pod-a.gw:8081/",
            },
        }
    )
    mine = WorkerSpec(0, "pod-a-w0", 8080, None, "http://ignored:1").apply(config)
    assert (mine.cluster.store, mine.cluster.redis_url) == ("redis", "redis://r:6379/0")
    assert mine.cluster.advertise_admin_url == "http://pod-a.gw:8081/"  # the operator's
    assert instance_base(config.cluster) == "pod-a"
    assert public_admin_url(config, 8081) == "http://pod-a.gw:8081"


def test_the_parent_advertises_a_reachable_address_for_a_wildcard_admin_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    config = parse_config(
        {
            "replicas": [{"url": "http://127.0.0.1:9", "model": "m"}],
            "admin": {"enabled": True, "host": "0.0.0.0", "port": 0, "token_hash": "sha256:00"},
        }
    )
    assert public_admin_url(config, 40001) == "http://10.1.2.3:40001"
