"""An Airflow DAG that trains a model with Frenzy: start `frenzy-submit` on the Prefect server,
then wait for it in a sensor (the worker slot is free while the model trains).

Copy it into Airflow's dags folder, in an Airflow environment where Frenzy was installed with
`pip install --no-deps <frenzy checkout or wheel>` (docs/prefect.md, "Airflow"), and point it at
the Prefect server:

    export PREFECT_API_URL=http://prefect-host:4200/api
    airflow dags test frenzy_train

The job is Frenzy's tiny example, small enough for a CPU pool; put a real model, data and
`train_tokens` here. `FRENZY_DAG_JOB` (JSON) replaces it without editing the file.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

try:                                   # Airflow 3
    from airflow.sdk import DAG
except ImportError:                    # Airflow 2
    from airflow import DAG

from frenzy_airflow.operators import FrenzyFlowRunSensor, FrenzySubmitOperator

JOB = {"name": "airflow-tiny", "model": "gpt2-tiny", "seq_len": 32, "global_batch": 4, "train_steps": 2,
       "precision": "fp32", "lr": 0.003, "checkpoint_every": 2, "data": {"kind": "synthetic"}}
JOB = json.loads(os.environ["FRENZY_DAG_JOB"]) if os.environ.get("FRENZY_DAG_JOB") else JOB

with DAG("frenzy_train", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         tags=["frenzy"]) as dag:
    # api_url defaults to PREFECT_API_URL; or prefect_conn_id= an Airflow connection
    start = FrenzySubmitOperator(task_id="start", job=JOB, wait=False)
    done = FrenzyFlowRunSensor(task_id="done", flow_run_id=start.output, poke_interval=5,
                               timeout=1800, mode="poke")
    start >> done
