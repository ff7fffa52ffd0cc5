"""Synthetic, verifiable tasks that Laminar can train on without any dataset hub, and the
held-out evaluator every task is judged by.

    countup   "37+8>60?" -> "37+8=45<60;45+8=53<60;53+8=61>60;#61": a chain of steps of
              long-tailed count, learnable by a tiny character-level model on CPU
              (the default demo)
    tooluse   "47*86=?" -> a calculator call, its answer, "#4042"; "47+6=?" -> "#53": the
              tool demo (python -m laminar.demo.tooldemo), where RL learns to call the tool
    colours   "colour?" + a generated image -> "#red": the vision-language demo task (the
              answer is only in the image; docs/vision.md)
    base      the Task protocol: held-out prompts, how a completion scores, optionally the
              environment and tools of its episodes
    evaluate  greedy completions (or episodes) of a Task's prompts, scored: the trainer's
              validation and both demos' held-out figures

Each task module offers `generate` (rows in memory), `write_splits` (train.jsonl /
eval.jsonl), `solve`, `demonstration` (imperfect solutions for a warm-up),
`verify`, and `reward(prompt, completion, **row)`; and a CLI:

    python -m laminar.tasks.countup --out data/countup --train 20000 --eval 500 --seed 0
"""
