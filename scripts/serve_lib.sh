# Shared by the serving scripts: start `m31 serve` in the background and wait until it is
# ready, or show its log and fail if it dies first; stop it. Source it; needs M31 and PORT.
#   start_server LOG [m31 serve options...]    sets $server to its pid
#   stop_server                                SIGINT, then wait for it
server=
start_server() {
  local log=$1
  shift
  "$M31" serve --port "$PORT" "$@" >"$log" 2>&1 &
  server=$!
  until curl -sf "http://127.0.0.1:$PORT/health/ready" >/dev/null; do
    kill -0 "$server" || { cat "$log"; exit 1; }
    sleep 0.5
  done
}
stop_server() {
  if [ -n "$server" ]; then
    kill -INT "$server" 2>/dev/null || true
    wait "$server" || true
    server=
  fi
}
