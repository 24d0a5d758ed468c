"""The CPU preset's Ray listens on loopback only.

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

import pytest
from helpers import cpu_config, dead_url

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


@pytest.mark.slow  # a Ray cluster: ~10 s
def test_cpu_preset_ray_listens_on_loopback_only():
    env = cpu_config(model_path="m", train_files="t", val_files="v").env()
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


GROUP_SCRIPT = r"""
import json, os, psutil, torch, torch.distributed as dist
if os.environ["PATCHED"] == "1":
    from ttsrl.verl_plugin.patches import _patch_init_process_group
    _patch_init_process_group()
# as verl.utils.distributed.initialize_global_process_group_ray calls it on CPU
dist.init_process_group(backend="cpu:gloo,cpu:gloo" if os.environ["PATCHED"] == "1" else "cpu:gloo",
                        rank=0, world_size=1, init_method=None)
t = torch.ones(3)
dist.all_reduce(t)
listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN]
dist.destroy_process_group()
print("RESULT " + json.dumps({"sum": t.tolist(), "listening": listening}))
"""


@pytest.mark.slow  # a torch.distributed process: ~5 s
def test_one_process_group_listens_on_no_interface():
    """verl's FSDP workers form a torch.distributed group of one on the CPU preset; the env://
    rendezvous would start a TCPStore on every interface (seen as '*:PORT ray::WorkerDict')."""
    def run(patched: str) -> dict:
        env = {**os.environ, "PATCHED": patched, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
               "RANK": "0", "WORLD_SIZE": "1", "VERL_PLATFORM": "cpu"}
        r = subprocess.run([sys.executable, "-c", GROUP_SCRIPT], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(r.stdout.split("RESULT ", 1)[1])

    before, after = run("0"), run("1")
    assert any(ip not in LOOPBACK for ip, _ in before["listening"]), before  # the store torch starts
    assert after["sum"] == [1.0, 1.0, 1.0]
    assert not [x for x in after["listening"] if x[0] not in LOOPBACK], after


GROUP2_SCRIPT = r"""
import json, os, psutil, torch, torch.distributed as dist
if os.environ["PATCHED"] == "1":
    from ttsrl.verl_plugin.patches import _patch_init_process_group
    _patch_init_process_group()
rank = int(os.environ["RANK"])
# as verl.utils.distributed.initialize_global_process_group_ray calls it on CPU, FSDP world size 2
dist.init_process_group(backend="cpu:gloo,cpu:gloo" if os.environ["PATCHED"] == "1" else "cpu:gloo",
                        rank=rank, world_size=2, init_method=None)
t = torch.ones(3)
dist.all_reduce(t)
shard = torch.empty(2)
dist.reduce_scatter_tensor(shard, torch.arange(4.0) + rank)  # FSDP2's gradient reduction
full = torch.empty(4)
dist.all_gather_into_tensor(full, shard)  # FSDP2's parameter gathering
listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN]
dist.barrier()
dist.destroy_process_group()
print("RESULT " + json.dumps({"sum": t.tolist(), "shard": shard.tolist(), "full": full.tolist(),
                              "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "listening": listening}))
"""


@pytest.mark.slow  # two torch.distributed processes: ~12 s
def test_two_process_group_listens_on_loopback_only():
    """FSDP world size 2 on one host: verl's master address is the node's 127.0.0.1,
    but torch's env:// rendezvous serves rank 0's TCPStore on every interface ('::'). The
    patch serves it on MASTER_ADDR only and pins gloo to the loopback interface; the
    collectives FSDP2 uses (all_reduce, reduce_scatter, all_gather) work across the 2 ranks."""
    def run(patched: str) -> list[dict]:
        port = dead_url().rsplit(":", 1)[1]
        env = {**os.environ, "PATCHED": patched, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
               "VERL_PLATFORM": "cpu"}
        env.pop("GLOO_SOCKET_IFNAME", None)
        procs = [subprocess.Popen([sys.executable, "-c", GROUP2_SCRIPT], env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
            out.append(json.loads(stdout.split("RESULT ", 1)[1]))
        return out

    before, after = run("0"), run("1")
    assert any(ip not in LOOPBACK for ip, _ in before[0]["listening"]), before  # the store torch starts
    for rank, r in enumerate(after):
        assert r["sum"] == [2.0, 2.0, 2.0] and r["full"] == [1.0, 3.0, 5.0, 7.0], r
        assert r["shard"] == ([1.0, 3.0] if rank == 0 else [5.0, 7.0]), r
        assert r["ifname"] and not [x for x in r["listening"] if x[0] not in LOOPBACK], r
    assert len(after[0]["listening"]) > len(after[1]["listening"])  # rank 0 serves the store (on loopback)
