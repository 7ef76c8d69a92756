"""Run Frenzy from Airflow over Prefect's REST API (Airflow and Prefect live in separate
environments). ``frenzy_airflow.client`` needs only httpx; ``frenzy_airflow.operators`` needs
Airflow and is imported on first use of ``FrenzySubmitOperator`` / ``FrenzyFlowRunSensor``."""
from .client import FrenzyRunFailed, idempotency_key, make_client, trigger, wait

__all__ = ["FrenzyRunFailed", "idempotency_key", "make_client", "trigger", "wait",
           "FrenzySubmitOperator", "FrenzyFlowRunSensor"]


def __getattr__(name: str):
    if name in ("FrenzySubmitOperator", "FrenzyFlowRunSensor"):
        from . import operators
        return getattr(operators, name)
    raise AttributeError(name)
