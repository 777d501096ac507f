#!/usr/bin/env bash
# Cloud TPU VM (single host or pod slice): create it, copy this checkout to every worker,
# install, and run one experiment on all workers at once.
#
#   launch/tpu_vm.sh create                 # gcloud compute tpus tpu-vm create
#   launch/tpu_vm.sh setup                  # copy the checkout to every worker and pip install
#   launch/tpu_vm.sh run python3 -m experiments.lm --config=experiments/configs/gpt2_small.py \
#       --workdir=gs://BUCKET/gpt2 --config.mesh.data=-1 --config.mesh.fsdp=4
#   launch/tpu_vm.sh ssh                    # a shell on worker 0
#   launch/tpu_vm.sh delete
#
# `run` starts the command on every worker (--worker=all) with --config.distributed.mode=on
# appended: each worker is one jax process, jax finds the coordinator, process count and id
# from the TPU metadata, and the mesh spans every chip of the slice. The workdir must be
# storage that all workers share (a gs:// bucket or a mounted filesystem): orbax writes each
# worker's shards of a checkpoint there. Logs of all workers stream to this terminal.
#
# Environment: TPU_NAME (required), ZONE (required), ACCELERATOR_TYPE (default v5litepod-8),
# RUNTIME_VERSION (default v2-alpha-tpuv5-lite), PROJECT (default: gcloud's), REMOTE_DIR
# (default transformer_jax), JAX_PIP_SPEC (default "jax[tpu]").
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
action=$1
shift
: "${TPU_NAME:?set TPU_NAME, the TPU VM name}"
: "${ZONE:?set ZONE, e.g. us-central2-b}"
accelerator_type=${ACCELERATOR_TYPE:-v5litepod-8}
runtime_version=${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}
remote_dir=${REMOTE_DIR:-transformer_jax}
jax_pip_spec=${JAX_PIP_SPEC:-jax[tpu]}
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

gcloud_tpu=(gcloud compute tpus tpu-vm)
common=(--zone="$ZONE")
if [[ -n "${PROJECT:-}" ]]; then
  common+=(--project="$PROJECT")
fi

on_all_workers() {  # on_all_workers 'shell command'
  "${gcloud_tpu[@]}" ssh "$TPU_NAME" "${common[@]}" --worker=all --command="$1"
}

case "$action" in
  create)
    "${gcloud_tpu[@]}" create "$TPU_NAME" "${common[@]}" \
      --accelerator-type="$accelerator_type" --version="$runtime_version"
    ;;
  setup)
    archive=$(mktemp -t transformer_jax.XXXXXX.tar.gz)
    trap 'rm -f "$archive"' EXIT
    git -C "$repo_root" archive --format=tar.gz -o "$archive" HEAD
    "${gcloud_tpu[@]}" scp "$archive" "$TPU_NAME":transformer_jax.tar.gz "${common[@]}" --worker=all
    on_all_workers "set -e; mkdir -p $(printf '%q' "$remote_dir"); \
      tar -xzf transformer_jax.tar.gz -C $(printf '%q' "$remote_dir"); \
      python3 -m pip install -q -U $(printf '%q' "$jax_pip_spec") && \
      python3 -m pip install -q -e $(printf '%q' "$remote_dir")"
    ;;
  run)
    [[ $# -ge 1 ]] || usage
    command_line=$(printf '%q ' "$@" --config.distributed.mode=on)
    cd_remote="cd $(printf '%q' "$remote_dir")"
    on_all_workers "$cd_remote && TRANSFORMER_JAX_ALLOCATOR=system $command_line"
    ;;
  ssh)
    "${gcloud_tpu[@]}" ssh "$TPU_NAME" "${common[@]}" --worker=0
    ;;
  delete)
    "${gcloud_tpu[@]}" delete "$TPU_NAME" "${common[@]}" --quiet
    ;;
  *)
    usage
    ;;
esac
