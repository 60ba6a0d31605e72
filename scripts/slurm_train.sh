#!/usr/bin/env bash
# Multi-node hf-tp train under Slurm: one task per node; hf-tp starts that node's ranks through
# accelerate's launcher. Submit with: sbatch scripts/slurm_train.sh configs/mistral-7b.yaml
#
# Preemption: Slurm sends SIGUSR1 to every task 120 s before the time limit (or before a
# preemption, where the cluster grants a grace time); hf-tp passes it to its ranks, which finish
# the step in flight, save a checkpoint and exit with code 75. The job then requeues itself and the
# next allocation continues with --resume (which starts from step 0 when there is no checkpoint).
#SBATCH --job-name=hf-tp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -uo pipefail
CONFIG=${1:?usage: sbatch scripts/slurm_train.sh CONFIG.yaml [more hf-tp train flags]}
shift
EXIT_PREEMPTED=75  # hf_tp.run.faults.EXIT_PREEMPTED
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
srun --kill-on-bad-exit=1 bash -c "exec hf-tp train --config '$CONFIG' --resume --nnodes $SLURM_NNODES \
  --node-rank \$SLURM_NODEID --master-addr $MASTER_ADDR --master-port $MASTER_PORT $*"
code=$?
if [ "$code" -eq "$EXIT_PREEMPTED" ]; then
  echo "hf-tp: preempted with a checkpoint saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
