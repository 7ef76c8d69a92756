"""The hard stop: cancel, through Prefect, the flow run of a job whose run did not answer the
scheduler's re-size or stop request in time (``ledger.queue.JobQueue.overdue``).

The flow run goes to Cancelling; the worker (or runner) that started its process sends it
SIGTERM and, 30 s later, SIGKILL (Prefect's fixed grace). The scheduler does not wait for that:
the ledger frees the run's GPUs at once (``JobQueue.cancel_run``), which also fences a run that
is still alive (its next lease renewal fails, and the trainer stops at its next step boundary).
"""
from __future__ import annotations

import logging

log = logging.getLogger("frenzy.scheduler")


def cancel_flow_run(flow_run_id: str, message: str) -> bool:
    """Set the flow run to Cancelling (unless it already ended); True if this call did."""
    from uuid import UUID

    from prefect import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(UUID(str(flow_run_id)))
        if fr.state is not None and fr.state.is_final():
            log.info("flow run %s already ended %s: nothing to cancel", flow_run_id, fr.state.name)
            return False
        client.set_flow_run_state(fr.id, Cancelling(message=message), force=True)
        return True
