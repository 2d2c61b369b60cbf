# Sourced by the served-benchmark scripts: start_server runs a server command in the background (its output into
# the file given), stopped however the script ends (a failed pass under `set -e` included: a server left running
# would share the cores with every later measurement); wait_healthy waits (up to 5 minutes) for the server on $PORT
# to answer /health, as kvserve and llama-server both do once loaded; stop_server stops it.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # run rather than sourced: say what it is for
  awk '!/^#/ {exit} {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
start_server() {  # log file, command...
  local log=$1; shift
  "$@" >"$log" 2>&1 &
  server_pid=$!
  trap stop_server EXIT
}
stop_server() {
  [ -n "${server_pid:-}" ] || return 0
  kill "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}
wait_healthy() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.5
  done
  echo "server on port $PORT did not come up" >&2; return 1
}
