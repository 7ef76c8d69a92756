"""The c10d store of a one-node run listens on 127.0.0.1 only (trainer.bound_launch): read from
the kernel's socket tables, not from what torch says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from trainer.launcher import launch_env
from trainer.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

# Create torch elastic's static rendezvous store the way the agent does, then report every
# listening socket on its port from /proc/net/tcp and tcp6 (local address in hex).
PROBE = textwrap.dedent("""
    import json, sys
    from trainer import bound_launch
    if sys.argv[2] == "bound":
        bound_launch.patch_static_rendezvous("127.0.0.1")
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    port = int(sys.argv[1])
    info = StaticTCPRendezvous("127.0.0.1", port, 0, 1, "probe", 30).next_rendezvous()
    info.store.set("k", "v")
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            f = line.split()
            addr, hexport = f[1].rsplit(":", 1)
            if int(hexport, 16) == port and f[3] == "0A":      # 0A: LISTEN
                listening.append(addr)
    print(json.dumps(listening))
""")


def listening_addresses(mode: str) -> list[str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(port), mode], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_store_listens_on_loopback_only():
    bound = listening_addresses("bound")
    assert bound == ["0100007F"]                   # 127.0.0.1, nothing on 0.0.0.0 or ::


def test_unpatched_store_listens_on_all_interfaces():
    """What the patch prevents (and proof that the probe sees it)."""
    plain = listening_addresses("plain")
    assert plain and all(a.strip("0") == "" for a in plain)     # 0.0.0.0 / ::


def test_one_node_env_keeps_the_rendezvous_on_loopback():
    env = launch_env(["0", "1"], cpu=True, base={})
    assert env["FRENZY_C10D_BIND"] == env["MASTER_ADDR"] == "127.0.0.1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    multi = launch_env(["n0:0", "n1:0"], cpu=False, base={})
    assert "FRENZY_C10D_BIND" not in multi and "GLOO_SOCKET_IFNAME" not in multi
