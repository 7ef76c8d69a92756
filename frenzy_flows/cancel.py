"""Stop a Prefect flow run: the one way Frenzy cancels a training, a gang node's run or a
submission that no longer answers.

What a state change does in Prefect 3 decides which one to set:

* a **running** flow run goes to Cancelling: the worker (or runner) that started its process
  sees it and sends the process SIGTERM, then SIGKILL after its fixed 30 s grace; the trainer's
  launcher kills its ranks with it. Setting Cancelled here instead would leave the process
  running, holding the GPUs the ledger has already freed;
* a run **not started yet** (Scheduled, Pending) or stuck in Cancelling (its worker vanished
  with it, nobody is left to act) is set Cancelled at once, so no worker picks it up later;
* a run already **final** is left alone.

Best effort: a server that cannot be reached is logged, never raised, so the error that made
the caller stop (a timeout, a failed node, an interrupt) is the one the user sees.
"""
from __future__ import annotations

import logging
from uuid import UUID

log = logging.getLogger("frenzy.cancel")


def cancel_flow_run(flow_run_id: str | UUID, reason: str) -> bool:
    """Stop the flow run as above; True if this call changed its state."""
    from prefect import get_client
    from prefect.states import Cancelled, Cancelling

    try:
        with get_client(sync_client=True) as client:
            fr = client.read_flow_run(UUID(str(flow_run_id)))
            st = fr.state
            if st is not None and st.is_final():
                log.info("flow run %s already ended %s: nothing to cancel", flow_run_id, st.name)
                return False
            new = Cancelling(message=reason) if st is not None and st.is_running() else Cancelled(message=reason)
            client.set_flow_run_state(fr.id, new, force=True)
            return True
    except Exception as err:  # best effort: never mask the caller's own error
        log.warning("could not cancel flow run %s: %s", flow_run_id, err)
        return False
