"""The trainer role. node.py wires the parts below and runs the step loop; no part sees the node.

node.py        TrainerNode: rank 0 asks, steps, publishes, commits, checkpoints; ranks > 0 follow
engine.py      the `Trainer` protocol (prepare, step, export, save/restore, close) + open_trainer,
               which picks the implementation once from trainer.engine and resumes it
policy.py      torch Trainer: HF model + AdamW + schedule; one optimizer step per batch; FSDP2
sim.py         sim Trainer: no model, step time proportional to tokens
follower.py    ranks > 0: run each collective rank 0 announces, until stop
dist.py        torch.distributed process group, rank commands (`lead`, `broadcast_message`)
feed.py        BatchRequest long-poll to the buffer, with the restart flag
commits.py     exactly-once: commits owed to the buffer, frontier, consumed.jsonl, version mark
checkpoint.py  atomic checkpoints (HF model dir + optimizer/scheduler/RNG + frontier), resume: auto
snapshots.py   model-only weight snapshots for evaluation after the run
batch.py       trajectories -> validated samples -> length-packed, right-padded micro-batches
logger.py      metrics.jsonl, completions.jsonl, TensorBoard, optional wandb
evaluation.py  periodic greedy validation on data.eval (eval/accuracy)

New versions leave through the weights channel's publisher (laminar/weights/channel.py).
Imports go one way: node.py -> parts -> laminar.{algo,protocol,transport,config}; no part imports
node.py; only dist.py, policy.py and follower.py speak rank commands.
"""
