#!/usr/bin/env bash
# Runs N copies of a command on this machine as one jax.distributed job on CPU: the way to try
# multi-host training (and what tests/test_multihost.py runs) without a cluster.
#
#   launch/local_multiprocess.sh N COMMAND [ARGS...]
#   launch/local_multiprocess.sh 2 python -m experiments.lm \
#       --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc2
#
# Process i gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i, which
# transformer_jax/parallel/distributed.py reads, and JAX_PLATFORMS=cpu: the processes exchange data over
# gloo, jax's CPU collectives. Each has one CPU device unless XLA_FLAGS sets
# --xla_force_host_platform_device_count=K. Output lines are prefixed with [i]. When a process
# fails the others are stopped (they would wait for it forever); the exit status is the first
# failure's. Environment: COORDINATOR_PORT (default: a free port), LOG_DIR (also keep
# LOG_DIR/process_i.log).
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES COMMAND [ARGS...]" >&2
  exit 2
fi
num_processes=$1
shift

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}
port=${COORDINATOR_PORT:-$(free_port)}
if [[ -n "${LOG_DIR:-}" ]]; then
  mkdir -p "$LOG_DIR"
fi

prefix_output() {  # prefix_output INDEX: stdin -> "[INDEX] line" (and LOG_DIR/process_INDEX.log)
  if [[ -n "${LOG_DIR:-}" ]]; then
    tee "${LOG_DIR}/process_$1.log" | sed -u "s/^/[$1] /"
  else
    sed -u "s/^/[$1] /"
  fi
}

pids=()
stop_all() {
  for pid in "${pids[@]}"; do
    if [[ -n "$pid" ]]; then
      kill "$pid" 2>/dev/null || true
    fi
  done
}
trap 'stop_all; exit 130' INT TERM

for ((i = 0; i < num_processes; i++)); do
  JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}" JAX_NUM_PROCESSES="$num_processes" \
    JAX_PROCESS_ID="$i" JAX_PLATFORMS=cpu "$@" > >(prefix_output "$i") 2>&1 &
  pids+=("$!")
done

status=0
while true; do
  alive=0
  for index in "${!pids[@]}"; do
    pid=${pids[$index]}
    if [[ -z "$pid" ]]; then
      continue
    fi
    if kill -0 "$pid" 2>/dev/null; then
      alive=1
      continue
    fi
    code=0
    wait "$pid" || code=$?
    pids[index]=""
    if [[ $code -ne 0 && $status -eq 0 ]]; then
      status=$code
      echo "local_multiprocess: process $index exited with status $code; stopping the others" >&2
      stop_all
    fi
  done
  if [[ $alive -eq 0 ]]; then
    break
  fi
  sleep 0.5
done
wait  # the output filters
exit "$status"
