# Sourced by common.sh and eval.sh: stopping the processes a launcher started.

# stop_and_wait PID...: SIGTERM each, then wait until it has exited (uvicorn's graceful shutdown takes a moment; a
# SIGKILL after 30 s), so that nothing a script started still answers on its port after the script ends.
stop_and_wait() {
    local pid i
    for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
    for pid in "$@"; do
        for ((i = 0; i < 300; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
}
