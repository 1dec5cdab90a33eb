#!/usr/bin/env bash
# Helpers for slurm/megarl.sbatch: a Ray cluster that lives exactly as long as one Slurm job.
#
# Sourced by the sbatch script (functions below), and executed by `srun` on each node as
#   bash ray_cluster.sh node head|worker
# to pick free ports on that node and run `ray start --block` there.
#
# Nothing here uses `ray stop` or pkill: `ray stop` ends every Ray process of the user on the
# node, including other jobs'. Teardown signals only the `srun` steps this job started.

RAY_JOIN_TIMEOUT_S=${MEGARL_RAY_JOIN_TIMEOUT_S:-120}
RAY_STOP_WAIT_S=${MEGARL_RAY_STOP_WAIT_S:-20}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

setup_environment() {
    PY=${MEGARL_PYTHON:-$MEGARL_HOME/.venv/bin/python}
    [[ -x "$PY" ]] || { echo "megarl.sbatch: no python at $PY (set MEGARL_PYTHON)" >&2; exit 2; }
    RAY_BIN="$(dirname "$PY")/ray"
    export PY RAY_BIN
    export PYTHONPATH="$MEGARL_HOME${PYTHONPATH:+:$PYTHONPATH}"
    export RAY_USAGE_STATS_ENABLED=0
    # A token for this job's cluster only (srun hands the environment to every node's step), so
    # a token file in ~/.ray left by another cluster never decides who may connect.
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}
    export RAY_AUTH_TOKEN
    export RAY_TMP="/tmp/megarl-ray-${SLURM_JOB_ID}"   # short: Ray's socket paths must fit 107 bytes
}

# ------------------------------------------------------------------ sbatch steps

resolve_run_dir() {
    # RUN_DIR from a trainer.run_dir=... override, else runs/slurm-<job id>; absolute, relative
    # to the submit directory. TRAIN_ARGS: the user's overrides with the absolute run dir.
    local submit=${SLURM_SUBMIT_DIR:-$PWD} arg
    RUN_DIR="runs/slurm-${SLURM_JOB_ID}"
    TRAIN_ARGS=()
    for arg in "$@"; do
        if [[ "$arg" == trainer.run_dir=* ]]; then RUN_DIR=${arg#trainer.run_dir=}; else TRAIN_ARGS+=("$arg"); fi
    done
    [[ "$RUN_DIR" == /* ]] || RUN_DIR="$submit/$RUN_DIR"
    TRAIN_ARGS+=("trainer.run_dir=$RUN_DIR")
    LOG_DIR="$RUN_DIR/logs"
    mkdir -p "$LOG_DIR"
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    HEAD_NODE=${NODES[0]}
    RAY_STEP_PIDS=()
    echo "megarl.sbatch: job $SLURM_JOB_ID on ${NODES[*]}; repo $MEGARL_HOME; logs in $LOG_DIR"
}

start_ray_head() {
    # The batch script runs on the allocation's first node, so the head's IP and port are local.
    HEAD_IP=${MEGARL_RAY_HEAD_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}
    HEAD_IP=${HEAD_IP:-127.0.0.1}
    export RAY_HEAD_ADDRESS="$HEAD_IP:$(free_port)" HEAD_IP
    start_node_step "$HEAD_NODE" head
    await_nodes 1 "$HEAD_NODE"
}

start_ray_workers() {
    local i
    for ((i = 1; i < ${#NODES[@]}; i++)); do
        start_node_step "${NODES[$i]}" worker
        await_nodes $((i + 1)) "${NODES[$i]}"
    done
}

start_node_step() {  # node, role: a background srun step running `ray start --block` there
    local node=$1 role=$2
    # --overlap: the batch step holds the node's CPUs. GPUs are handed to the step explicitly.
    srun --overlap --nodes=1 --ntasks=1 -w "$node" --kill-on-bad-exit=0 \
        ${SLURM_GPUS_ON_NODE:+--gres=gpu:$SLURM_GPUS_ON_NODE} \
        bash "$MEGARL_HOME/slurm/ray_cluster.sh" node "$role" \
        >"$LOG_DIR/ray-$role-$node.log" 2>&1 &
    RAY_STEP_PIDS+=("$!")
    LAST_STEP_PID=$!
}

await_nodes() {  # count, node: wait until the cluster has `count` live nodes, or fail naming node
    local count=$1 node=$2
    if ! "$PY" "$MEGARL_HOME/slurm/ray_wait.py" --address "$RAY_HEAD_ADDRESS" --nodes "$count" \
            --timeout "$RAY_JOIN_TIMEOUT_S" --node "$node" --step-pid "$LAST_STEP_PID" \
            --log "$LOG_DIR/ray-$([[ $count == 1 ]] && echo head || echo worker)-$node.log"; then
        exit 3
    fi
}

run_megarl_train() {
    echo "megarl.sbatch: megarl-train ${TRAIN_ARGS[*]}"
    set +e
    RAY_ADDRESS="$RAY_HEAD_ADDRESS" "$PY" -m megarl.train "${TRAIN_ARGS[@]}" 2>&1 | tee "$LOG_DIR/train.log"
    TRAIN_EXIT=${PIPESTATUS[0]}
    set -e
    echo "megarl.sbatch: megarl-train exited with $TRAIN_EXIT"
}

stop_ray_cluster() {
    # Workers first, then the head: SIGTERM to our own srun steps (srun forwards it to
    # `ray start --block`, which stops the Ray processes it started); SIGKILL after a grace period.
    local i pid deadline
    for ((i = ${#RAY_STEP_PIDS[@]} - 1; i >= 0; i--)); do
        kill -TERM "${RAY_STEP_PIDS[$i]}" 2>/dev/null || true
    done
    deadline=$((SECONDS + RAY_STOP_WAIT_S))
    for pid in "${RAY_STEP_PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$RAY_TMP"
}

# ------------------------------------------------------------------ per-node entry (under srun)

run_ray_node() {  # head|worker
    local role=$1 common
    common=(--block --disable-usage-stats --temp-dir="$RAY_TMP"
            --dashboard-agent-listen-port="$(free_port)")
    if [[ -n "${MEGARL_RAY_OBJECT_STORE_BYTES:-}" ]]; then
        common+=(--object-store-memory="$MEGARL_RAY_OBJECT_STORE_BYTES")
    fi
    echo "ray node ($role) on $(hostname) [slurm node ${SLURMD_NODENAME:-?}]"
    if [[ "$role" == head ]]; then
        exec "$RAY_BIN" start --head --node-ip-address="$HEAD_IP" --port="${RAY_HEAD_ADDRESS##*:}" \
            --include-dashboard=false --ray-client-server-port="$(free_port)" "${common[@]}"
    fi
    # shellcheck disable=SC2086  # MEGARL_RAY_WORKER_ARGS: extra `ray start` flags, word-split
    exec "$RAY_BIN" start --address="$RAY_HEAD_ADDRESS" "${common[@]}" ${MEGARL_RAY_WORKER_ARGS:-}
}

if [[ "${BASH_SOURCE[0]}" == "$0" && "${1:-}" == node ]]; then
    set -euo pipefail
    run_ray_node "$2"
fi
