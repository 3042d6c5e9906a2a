"""A DP=2 policy with one rank on each of two Ray nodes trains exactly like the same run on one node.

The second node is a real raylet joining the head with its own node address (127.0.0.2, another
loopback address; see the `two_node_cluster` fixture). The ranks meet at rank 0's node address and a
port free there, so the cross-node run must rendezvous at 127.0.0.2, the one-node run at the head's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skyrl_mtp.policy.megatron_policy import reproducible_metrics

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


def test_dp2_across_two_nodes_equals_one_node(two_node_cluster, tiny_ckpt, tmp_path):
    out = tmp_path / "results.pt"
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(two_node_cluster.token_file), "RAY_AUTH_MODE": "token",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(HERE / "two_node_driver.py"), two_node_cluster.gcs_address,
                           str(tiny_ckpt), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = torch.load(out, weights_only=False)
    one, two = res["one_node"], res["two_nodes"]
    # Ray registers a head started with --node-ip-address=127.0.0.1 under the host's primary address,
    # so the head's address is whatever Ray reports for it; the second node keeps its own 127.0.0.2.
    head = res["head_address"]
    assert head != "127.0.0.2"
    assert one["nodes"] == [head, head] and one["master_addr"] == head
    assert two["nodes"] == ["127.0.0.2", head]
    assert two["master_addr"] == "127.0.0.2"          # rank 0's node, not the driver's or the head's
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m1.keys() == m2.keys()
        assert reproducible_metrics(m1) == reproducible_metrics(m2)   # bitwise: same floats
    assert m1["policy/grad_norm"] > 0 and m1["mtp/grad_norm"] > 0
    assert one["weights"].keys() == two["weights"].keys()
    for k, v in one["weights"].items():
        assert torch.equal(v, two["weights"][k]), k
