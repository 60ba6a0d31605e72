#!/usr/bin/env bash
# Multi-node hf-tp train under Slurm: one task per node; hf-tp starts that node's ranks through
# accelerate's launcher. Submit with: sbatch scripts/slurm_train.sh configs/mistral-7b.yaml
#SBATCH --job-name=hf-tp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
CONFIG=${1:?usage: sbatch scripts/slurm_train.sh CONFIG.yaml [more hf-tp train flags]}
shift
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
srun --kill-on-bad-exit=1 bash -c "hf-tp train --config '$CONFIG' --nnodes $SLURM_NNODES \
  --node-rank \$SLURM_NODEID --master-addr $MASTER_ADDR --master-port $MASTER_PORT $*"
