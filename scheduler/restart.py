"""What a checkpoint restart costs: one formula for the policy's predictions (``frenzy`` weighs
growing, shrinking and recalling runs with it) and the simulator's truth (``sim.engine``
charges it). Pure: no torch, no server."""
from __future__ import annotations

CKPT_BYTES_PER_PARAM = 14.0   # bf16 weights + fp32 master weights + Adam m and v


def checkpoint_gb(params: float) -> float:
    """Size of a training checkpoint (model and optimizer states) of a model of ``params``."""
    return CKPT_BYTES_PER_PARAM * params / 1e9


def checkpoint_move_s(state_gb: float, nodes: int, gbs_per_node: float) -> float:
    """Saving a checkpoint at preemption plus restoring it at the next start: every node the
    run spans writes / reads its shard in parallel at ``gbs_per_node`` GB/s."""
    return 2.0 * state_gb / (gbs_per_node * max(1, nodes))
