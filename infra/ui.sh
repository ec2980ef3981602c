#!/usr/bin/env bash
# `make ui` / `make ui-stop`: a local Prefect server (SQLite, loopback), the echo2-local process
# pool, the deployments of prefect.yaml and a worker. State and pids live in .echo2-ui/.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${ECHO2_UI_STATE:-$PWD/.echo2-ui}"
BIN="${BIN:-$PWD/.venv/bin}"
PORT="${ECHO2_UI_PORT:-4200}"
export PREFECT_HOME="$STATE/prefect-home"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 ECHO2_HOME="$PWD"
export PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT="$PORT"
export PREFECT_LOGGING_EXTRA_LOGGERS=echo2

start() {
  mkdir -p "$STATE"
  if [ -f "$STATE/server.pid" ] && kill -0 "$(cat "$STATE/server.pid")" 2>/dev/null; then
    echo "already running: http://127.0.0.1:$PORT (make ui-stop first)"; exit 0
  fi
  setsid "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" >"$STATE/server.log" 2>&1 &
  echo $! >"$STATE/server.pid"
  for _ in $(seq 120); do
    curl -sf "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
    sleep 0.5
  done
  curl -sf "$PREFECT_API_URL/health" >/dev/null || { echo "server did not start; see $STATE/server.log"; exit 1; }
  # echo2-cloud: the pool of the git deployment, served by a worker elsewhere (infra/prefect/worker-task.yaml);
  # `deploy --all` refuses a deployment whose pool does not exist
  for pool in echo2-local echo2-cloud; do
    "$BIN/prefect" work-pool inspect "$pool" >/dev/null 2>&1 || "$BIN/prefect" work-pool create "$pool" --type process >/dev/null
  done
  "$BIN/prefect" --no-prompt deploy --all >"$STATE/deploy.log" 2>&1 || { cat "$STATE/deploy.log"; exit 1; }
  setsid "$BIN/prefect" worker start --pool echo2-local --type process >"$STATE/worker.log" 2>&1 &
  echo $! >"$STATE/worker.pid"
  echo "Prefect UI: http://127.0.0.1:$PORT  (deployments echo2-train/quickstart, echo2-train/spot-multicloud, echo2-train/spot-multicloud-git)"
  echo "start a run: PREFECT_API_URL=$PREFECT_API_URL $BIN/prefect deployment run 'echo2-train/quickstart'"
}

stop() {
  for name in worker server; do
    pidfile="$STATE/$name.pid"
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    # the process group: the worker ignores a single SIGTERM, so a second signal follows
    kill -TERM -- "-$pid" 2>/dev/null || true
    sleep 1
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
  echo "stopped"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 [start|stop]"; exit 2 ;;
esac
