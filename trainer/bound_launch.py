"""``python -m trainer.bound_launch <accelerate launch arguments>``: ``accelerate launch``, with
torch elastic's c10d store listening on the job's node address only.

Torch elastic's static rendezvous makes the agent's ``TCPStore`` server listen on every
interface whatever address it is given (the address is only what clients dial), so any host
that reaches the node could talk to a job's store. Here the store gets a socket already bound
to ``FRENZY_C10D_BIND`` (the job's node address; 127.0.0.1 on one node) through TCPStore's
``master_listen_fd`` (libuv backend), which then listens only there. Without that variable
nothing changes.

The patch lives in this launcher process only (where the agent creates the store); the
ranks are clients of it.
"""
from __future__ import annotations

import os
import socket
import sys

BIND_ENV = "FRENZY_C10D_BIND"
# The listen backlog: every rank of the node connects once per store client it opens (a few
# per rank); 128 is the kernel's traditional default SOMAXCONN.
LISTEN_BACKLOG = 128

_sockets: list[socket.socket] = []      # kept open for the store's lifetime (this process)


def bound_listen_fd(address: str, port: int) -> int:
    """A listening TCP socket on ``address:port`` (its descriptor), for TCPStore."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(LISTEN_BACKLOG)
    _sockets.append(sock)
    return sock.fileno()


def patch_static_rendezvous(address: str) -> None:
    """Make the static rendezvous' master store listen on ``address`` only."""
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static

    real = static.TCPStore

    def store(host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and "master_listen_fd" not in kwargs:
            kwargs["master_listen_fd"] = bound_listen_fd(address, int(port))
            kwargs["use_libuv"] = True            # the backend that takes a listening descriptor
        return real(host_name, port, world_size, is_master, *args, **kwargs)

    static.TCPStore = store


def main(argv: list[str] | None = None) -> None:
    # The launcher stops when its runner is gone, as its ranks do: a node still waiting for its
    # gang's rendezvous has no ranks yet, and would otherwise wait out torch's rendezvous timeout
    # (15 min seen) after the runner that started it was killed.
    from trainer.train import watch_orchestrator

    watch_orchestrator(what="launcher")
    address = os.environ.get(BIND_ENV)
    if address:
        patch_static_rendezvous(address)
    from accelerate.commands.launch import main as accelerate_main

    sys.argv = ["accelerate-launch", *(sys.argv[1:] if argv is None else argv)]
    accelerate_main()


if __name__ == "__main__":
    main()
