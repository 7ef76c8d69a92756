#!/usr/bin/env bash
# `frenzy run JOB --plan nodes=2 --json` on one machine standing for two nodes: a Prefect
# server, `frenzy pools sync` of a CPU pool of 2 nodes x 1 process (it makes the work queues
# <pool>-0 and <pool>-1), one process worker per node queue, then the run. Prints the result's
# plan, status and losses. Usage: scripts/multinode_check.sh [job.yaml]   (heavy: run it alone)
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-examples/tiny-job.yaml}
WORK=$(mktemp -d)
export PREFECT_HOME=$WORK/prefect FRENZY_HOME=$WORK/frenzy PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONPATH=$PWD PREFECT_WORKER_QUERY_SECONDS=1
BIN=$(dirname "$(readlink -f .venv/bin/python)")
[ -x .venv/bin/prefect ] && BIN=$PWD/.venv/bin
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export PREFECT_API_URL=http://127.0.0.1:$PORT/api
cat > "$WORK/cluster.yaml" <<EOF
pools:
  - name: cpu2
    gpu: CPU
    nodes: 2
    gpus_per_node: 1
EOF
pids=()
cleanup() {   # each started process (and its group) by its own pid; SIGKILL what is left after 5 s
  for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  sleep 5; for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
setsid "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 & pids+=($!)
for _ in $(seq 1 180); do curl -sf "$PREFECT_API_URL/health" > /dev/null && break; sleep 1; done
"$BIN/frenzy" pools sync --cluster "$WORK/cluster.yaml"
for r in 0 1; do   # the node's address: loopback, both nodes being this machine
  FRENZY_NODE_ADDRESS=127.0.0.1 setsid "$BIN/prefect" worker start --pool cpu2 --work-queue "cpu2-$r" \
    --type process > "$WORK/worker-$r.log" 2>&1 & pids+=($!)
done
t0=$(date +%s)
"$BIN/frenzy" run "$JOB" --cluster "$WORK/cluster.yaml" --plan nodes=2 --json > "$WORK/result.json"
echo "frenzy run took $(( $(date +%s) - t0 )) s; files in $WORK"
.venv/bin/python - "$WORK/result.json" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
p = r.get("plan") or {}
print(json.dumps({"status": r.get("status"), "gpus": p.get("gpus"), "dp": p.get("dp"),
                  "placement": (r.get("allocation") or {}).get("placement"), "losses": r.get("losses"),
                  "error": r.get("error")}))
EOF
ls "$FRENZY_HOME"/runs/*/   # accelerate-node0.yaml, accelerate-node1.yaml, attempt-1-node1.log: both nodes trained there
