"""Start a real Redis Cluster on free loopback ports (redis-server x N + redis-cli --cluster
create), wait until every node agrees it is ready, and stop it by PID."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from dataclasses import dataclass, field

import redis

from devkit.redis_server import RedisProcess, redis_binary
from guard.connect import connect

NODE_TIMEOUT_MS = 1500
# A cluster node also listens on port + 10000 (the cluster bus), so ports stay under 55536.
PORT_RANGE = (20000, 45000)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free loopback port whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(*PORT_RANGE)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, all on 127.0.0.1."""

    nodes: list[RedisProcess] = field(default_factory=list)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @classmethod
    def start(cls, masters: int = 3, replicas: int = 0) -> LocalCluster:
        cluster = cls()
        try:
            for _ in range(masters * (1 + replicas)):
                port = cluster_port()
                cluster.nodes.append(
                    RedisProcess.start(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        str(NODE_TIMEOUT_MS),
                        port=port,
                    )
                )
            if masters == 1 and replicas == 0:
                # redis-cli refuses a one-node cluster; assign every slot by hand.
                client = connect(f"redis://127.0.0.1:{cluster.ports[0]}/0")
                client.execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
                client.close()
            else:
                subprocess.run(
                    [
                        redis_binary("redis-cli"),
                        "--cluster",
                        "create",
                        *(f"127.0.0.1:{p}" for p in cluster.ports),
                        "--cluster-replicas",
                        str(replicas),
                        "--cluster-yes",
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=60,
                )
            cluster.wait_ok(masters, replicas)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def client(self, port: int) -> redis.Redis:
        client: redis.Redis = connect(f"redis://127.0.0.1:{port}/0", socket_timeout=5)
        return client

    def wait_ok(self, masters: int, replicas: int, timeout: float = 30.0) -> None:
        """Every node: cluster_state ok, every slot covered, and the expected role count."""
        deadline = time.monotonic() + timeout
        while True:
            if all(self._node_ready(p, masters, replicas) for p in self.ports):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster on {self.ports} did not become ready")
            time.sleep(0.1)

    def _node_ready(self, port: int, masters: int, replicas: int) -> bool:
        client = self.client(port)
        try:
            info = client.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
            flags = [n["flags"] for n in client.execute_command("CLUSTER NODES").values()]
            live = [f for f in flags if "fail" not in f]
            if sum("master" in f for f in live) != masters:
                return False
            if sum("slave" in f for f in live) != masters * replicas:
                return False
            repl = client.info("replication")
            return repl.get("role") != "slave" or repl.get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
