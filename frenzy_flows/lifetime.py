"""The lifetime of a job's GPUs on the ledger: from the grant to the end, in one block.

    assignment = assign(...)                         # the ledger granted GPUs to job_id
    with allocation_lifetime(ledger_url, job_id, log=log.warning):
        ...artifacts, events, slots, run folder, training, fallbacks, re-sizes...
    # here every allocation of job_id is released, however the block ended

Whatever ends the block (a return, an exception at any step between the grant and the
training, a KeyboardInterrupt, a signal's stop) releases every allocation the ledger still
holds *for this job*, not only the first: an out-of-memory fallback or a re-size allocates
anew under the same job id. Releasing is idempotent (the trainer's own releases come first), so
nested blocks (the submit flow's, the train flow's) are safe. A ledger that cannot be reached
at the end is logged, never raised over the original error: the lease's TTL frees the GPUs then.
A train flow that hands its run on to the submit flow (the next allocation is another pool's
or node's) keeps that one allocation held for the launch there.

No prefect here; the flows call it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator


def release_job(ledger, job_id: str, log: Callable[[str], None] | None = None,
                keep: Collection[str] = ()) -> list[str]:
    """Release every active allocation of ``job_id`` but those in ``keep``; returns the ids
    this call released."""
    freed = []
    for alloc in ledger.allocations(active_only=True):
        if alloc.job_id == job_id and str(alloc.id) not in keep and ledger.release(alloc.id):
            freed.append(alloc.id)
    if freed and log is not None:
        log(f"frenzy: released {len(freed)} allocation(s) of job {job_id} left held at its end: "
            + ", ".join(freed))
    return freed


@contextlib.contextmanager
def allocation_lifetime(ledger_url: str | None, job_id: str,
                        log: Callable[[str], None] | None = None,
                        keep: Collection[str] = ()) -> Iterator[None]:
    """Release all of ``job_id``'s allocations when the block ends (module docstring), but
    those ``keep`` holds then: a run handed on to its submitter (``TrainResult.handoff``)
    leaves it the allocation it goes on from."""
    try:
        yield
    finally:
        try:
            from ledger import Ledger

            release_job(Ledger(ledger_url), job_id, log, keep=keep)
        except Exception as err:         # never mask what ended the block; the TTL frees the GPUs
            if log is not None:
                log(f"frenzy: could not release the allocations of job {job_id} ({type(err).__name__}: "
                    f"{err}); their lease expires on its own")
