# Sourced by the served-benchmark scripts: wait_healthy waits (up to 5 minutes) for the server on $PORT to answer
# /health, as kvserve and llama-server both do once loaded.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # run rather than sourced: say what it is for
  awk '!/^#/ {exit} {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
wait_healthy() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.5
  done
  echo "server on port $PORT did not come up" >&2; return 1
}
