"""The trainer role. node.py wires the parts below and runs the step loop; no part sees the node.

node.py          TrainerNode: rank 0 asks, steps, publishes, commits, checkpoints; ranks > 0 follow
protocol.py      the `Trainer` protocol (prepare, step, export, save/restore, close) and its
                 small types: TrainerSettings, PendingSave, Opened
factory.py       open_trainer: picks the implementation once from trainer.engine and resumes it
torch_trainer.py TorchTrainer: AdamW + schedule over a TrainedModel; one optimizer step per batch
model.py         TrainedModel: the causal LM (+ reference, LoRA, activation checkpointing, FSDP2),
                 its forward to log-probabilities, its weights out
sim.py           SimTrainer: no model, step time proportional to tokens
follower.py      ranks > 0: run each collective rank 0 announces, until stop
dist.py          torch.distributed process group, rank commands (`lead`, `broadcast_message`)
feed.py          BatchRequest long-poll to the buffer, with the restart flag
commits.py       exactly-once: commits owed to the buffer, frontier, consumed.jsonl, version mark
checkpoint.py    atomic checkpoints (HF model dir + optimizer/scheduler/RNG + frontier), resume:
                 auto; reads a trainer through its `Checkpointable` protocol
snapshots.py     model-only weight snapshots for evaluation after the run
batch.py         trajectories -> validated samples (TrainBatch)
packing.py       samples -> index lists: mini-batches, micro-batches under the token budget, by rank
micro_batch.py   an index list -> MicroBatch: right-padded tensors in the next-token frame
packed.py        the packed forward: each prompt once, no padding in the matmuls (PackedLayout)
logprobs.py      log-probabilities and entropies from hidden states, chunked, fp32
logger.py        metrics.jsonl, completions.jsonl, TensorBoard, optional wandb
evaluation.py    periodic greedy validation on data.eval (eval/accuracy)

The step goes down: torch_trainer -> packing, model -> micro_batch, packed, logprobs -> batch;
the loss and advantages from laminar/algo. New versions leave through the weights channel's
publisher (laminar/weights/channel.py). Imports go one way: node.py -> parts ->
laminar.{algo,protocol,transport,config}; no part imports node.py or factory.py; only dist.py,
torch_trainer.py and follower.py speak rank commands.
"""
