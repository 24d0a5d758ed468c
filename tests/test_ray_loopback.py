"""The CPU preset's Ray listens on loopback only (issue 11, item 7).

A real Ray 2.60 local cluster is started the way verl's main_ppo starts it (``ray.init``
in a process whose environment is ``GRPOConfig.env()`` of the CPU preset), with an
actor, and every listening TCP socket of that process tree is inspected. Without
``cpu_env()``'s ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` the GCS, raylet and workers
listen on all interfaces and the agents on the machine's network address.
"""

import json
import os
import subprocess
import sys

from ttsrl.grpo import GRPOConfig

SCRIPT = r"""
import json, os, psutil, ray
ray.init(num_cpus=1, num_gpus=0)

@ray.remote
class Probe:
    def node_ip(self):
        return ray.util.get_node_ip_address()

probe = Probe.remote()
node_ip = ray.get(probe.node_ip.remote())
listening = []
for p in [psutil.Process()] + psutil.Process().children(recursive=True):
    try:
        conns = p.net_connections(kind="inet")
        name = p.name()
    except psutil.Error:
        continue
    listening += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
ray.shutdown()
print("RESULT " + json.dumps({"node_ip": node_ip, "listening": listening}))
"""

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_cpu_preset_ray_listens_on_loopback_only():
    env = GRPOConfig.cpu_preset(model_path="m", train_files="t", val_files="v").env()
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env={**clean, **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert result["node_ip"] == "127.0.0.1"
    listening = result["listening"]
    names = " ".join(n for _, _, n in listening)
    assert len(listening) >= 5 and "gcs_server" in names and "raylet" in names, listening  # Ray's own servers seen
    exposed = [x for x in listening if x[0] not in LOOPBACK]
    assert not exposed, exposed
