"""The trainer's machinery, used by laminar/trainer/node.py (the node owns the network side).

policy.py      HF model + AdamW + schedule; one optimizer step per batch; FSDP2 across ranks
batch.py       trajectories -> validated samples -> length-packed, right-padded micro-batches
checkpoint.py  atomic checkpoints (HF model dir + optimizer/scheduler/RNG + frontier), resume: auto
handoff.py     how a new version leaves: relay tier | safetensors file | sim
logger.py      metrics.jsonl + TensorBoard + optional wandb
dist.py        torch.distributed process group and rank commands
sim.py         the sim trainer (step time proportional to tokens)
"""
