"""Frenzy's trainer: from a chosen plan to a real training run.

* ``launch_config``: Accelerate / DeepSpeed configs and the training spec, written to the run folder.
* ``launcher``: ``accelerate launch`` in its own process group, streamed, with a deadline.
* ``train``: the program every rank runs (``python -m trainer.train --run-dir DIR``).
* ``fallback``: the out-of-memory fallback plans, re-estimated by the estimator.
* ``runner``: ``run_training``, the attempt loop (retries, fallbacks, checkpoint resume).

No Prefect anywhere here and no torch at import: the flows wrap these functions.
"""
