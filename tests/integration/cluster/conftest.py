"""A real Ray head on loopback, started with `ray start --head --block`, and always stopped again.

`ray stop` is not used: it stops every Ray process on the machine, including other sessions'
clusters. The head runs in the foreground (`--block`) under this fixture, so SIGTERM to that one
process makes Ray kill exactly the processes it started; anything left over is found by the
head's private temp dir (in its command line) and killed by pid. Ports are all chosen free, the
temp dir is private (deleted afterwards, with its ray_current_cluster), and the cluster gets its
own auth token file so the test never depends on ~/.ray.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

HEAD_START_TIMEOUT_S = 180
# One engine + one policy worker (num_cpus=1 each) plus a spare for the job's driver-side tasks.
HEAD_NUM_CPUS = 3


@dataclass(frozen=True)
class LocalHead:
    dashboard_url: str
    gcs_address: str
    temp_dir: Path
    token_file: Path
    python_bin: Path


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _dashboard_up(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=2)
        return True
    except urllib.error.HTTPError:      # 401/403 under token auth: the server is up
        return True
    except OSError:
        return False


def _leftover_pids(temp_dir: Path) -> list[int]:
    """Processes of this head: those naming its private temp dir, and all their descendants."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(temp_dir) in " ".join(proc.info["cmdline"] or []):
                roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pids = set()
    for proc in roots:
        pids.add(proc.pid)
        try:
            pids.update(child.pid for child in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    pids.discard(os.getpid())
    return sorted(pids)


def stop_head(proc: subprocess.Popen, temp_dir: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while _leftover_pids(temp_dir) and time.monotonic() < deadline:
        time.sleep(1)
    for pid in _leftover_pids(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (temp_dir / "ray_current_cluster").unlink(missing_ok=True)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    python_bin = Path(sys.executable).parent
    ray_cli = python_bin / "ray"
    if not ray_cli.exists():
        pytest.fail(f"{ray_cli} not found: run the tests with the project's virtualenv python")
    # Short path: Ray's unix socket paths must stay under ~107 characters.
    temp_dir = Path(tempfile.mkdtemp(prefix="skyrl_head_", dir="/tmp"))
    token_file = temp_dir / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    (gcs, dash, client, node_mgr, obj_mgr, metrics, agent_listen, agent_grpc, rt_agent) = free_ports(9)
    cmd = [str(ray_cli), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--node-manager-port={node_mgr}",
           f"--object-manager-port={obj_mgr}", f"--metrics-export-port={metrics}",
           f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={rt_agent}", f"--num-cpus={HEAD_NUM_CPUS}", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    # The job's `python` is the one on the PATH the head had: put the venv first.
    env = {**os.environ, "PATH": f"{python_bin}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_TOKEN_PATH": str(token_file), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    log_path = temp_dir / "ray_start.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while not _dashboard_up(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray head did not come up (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield LocalHead(url, f"127.0.0.1:{gcs}", temp_dir, token_file, python_bin)
    finally:
        log.close()
        stop_head(proc, temp_dir)


@dataclass(frozen=True)
class TwoNodeCluster:
    gcs_address: str
    temp_dir: Path
    token_file: Path
    node_resources: tuple[str, str]  # a custom resource only the head / only the second node has


def _start_node(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()  # the child keeps its own descriptor


@pytest.fixture(scope="module")
def two_node_cluster():
    """A Ray cluster of two nodes on this machine: a head at 127.0.0.1 and a second raylet at 127.0.0.2
    (another loopback address) joining it with `ray start --address`. Each node has 2 CPUs and its own
    custom resource (`skyrl_node_a` / `skyrl_node_b`) so a test can place an actor on either."""
    python_bin = Path(sys.executable).parent
    ray_cli = python_bin / "ray"
    temp_dir = Path(tempfile.mkdtemp(prefix="skyrl_2n_", dir="/tmp"))
    token_file = temp_dir / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    # token auth on every node (a joining raylet does not send the token unless told the mode)
    env = {**os.environ, "PATH": f"{python_bin}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_TOKEN_PATH": str(token_file), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    gcs, *ports = free_ports(14)
    common = ["--block", "--num-cpus=2", "--num-gpus=0", "--object-store-memory=100000000",
              "--disable-usage-stats"]
    head_cmd = [str(ray_cli), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                "--include-dashboard=false", f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
                f"--metrics-export-port={ports[2]}", f"--dashboard-agent-listen-port={ports[3]}",
                f"--dashboard-agent-grpc-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
                f"--ray-client-server-port={ports[6]}", f"--temp-dir={temp_dir}",
                '--resources={"skyrl_node_a": 2}', *common]
    node_cmd = [str(ray_cli), "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.2",
                f"--node-manager-port={ports[7]}", f"--object-manager-port={ports[8]}",
                f"--metrics-export-port={ports[9]}", f"--dashboard-agent-listen-port={ports[10]}",
                f"--dashboard-agent-grpc-port={ports[11]}", f"--runtime-env-agent-port={ports[12]}",
                f"--temp-dir={temp_dir}", '--resources={"skyrl_node_b": 2}', *common]
    procs = [_start_node(head_cmd, env, temp_dir / "head.log")]
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while ("Ray runtime started" not in (temp_dir / "head.log").read_text() and procs[0].poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.5)  # the second node joins a running head
        procs.append(_start_node(node_cmd, env, temp_dir / "node_b.log"))
        # `ray start --block` prints this once its node is up (an actor that needs the second node's
        # resource waits in Ray's queue until that node has registered with the head)
        logs = (temp_dir / "head.log", temp_dir / "node_b.log")
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while not all(f.exists() and "Ray runtime started" in f.read_text() for f in logs):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                tails = "\n".join(f.read_text()[-2000:] for f in logs if f.exists())
                pytest.fail(f"two-node Ray cluster did not come up:\n{tails}")
            time.sleep(0.5)
        yield TwoNodeCluster(f"127.0.0.1:{gcs}", temp_dir, token_file, ("skyrl_node_a", "skyrl_node_b"))
    finally:
        for p in reversed(procs[1:]):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        stop_head(procs[0], temp_dir)
