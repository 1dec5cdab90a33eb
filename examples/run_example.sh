# Sourced by the example scripts: what every example does before and around its own overrides.
# From the repository root, install .venv on first use (`make install`), then `run_example NAME
# OVERRIDE...` runs megarl-train writing runs/NAME on a demo-sized batch (4 prompts x 4 samples).
# The example's overrides, and after them the user's ("$@"), come last: the last value of a key wins.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
make --no-print-directory install

run_example() {
    local name=$1
    shift
    exec .venv/bin/megarl-train \
        data.prompts_per_step=4 \
        rollout.n=4 \
        trainer.run_dir="runs/$name" \
        "$@"
}

# Two steps of an agent recipe, each trajectory's turns saved under runs/NAME/generations.
run_agent_example() {
    local name=$1 recipe=$2
    shift 2
    run_example "$name" \
        recipe="$recipe" \
        trainer.total_steps=2 \
        trainer.rollout_data_dir="runs/$name/generations" \
        "$@"
}
