"""Adapters to environment libraries users already have.

reasoning_gym.py: reasoning-gym's procedural generators as a dataset (jsonl rows for
data.train / data.eval) and a reward function (its generators' `score_answer`). Optional:
`pip install reasoning-gym`.

verifiers (checked against its docs and notes/TRAJECTORIES.md, v0.1.8+): no adapter, and
why. verifiers does record token-level trajectories per turn: `state["trajectory"]` is a
list of TrajectoryStep, one per model request, each with `tokens` = {prompt_ids,
prompt_mask, completion_ids, completion_mask, completion_logprobs} (None when the server
returned no token data). What blocks a Laminar adapter is who owns generation:

  * `Environment.rollout(input, client: AsyncOpenAI, model, sampling_args)` runs the whole
    turn loop itself and gets every model turn from an OpenAI-compatible chat/completions
    server; the token ids and logprobs are whatever that server returns. Laminar's rollout
    must own generation (Engine.submit / abort / resume on token ids) to stream partial
    tokens to the pool, repack mid-episode and pin one weight version per trajectory;
    there is no hook to hand verifiers a token-level engine instead of an OpenAI client.
  * each turn is an independent request whose prompt is re-rendered from messages by the
    server's chat template, so turn t+1's prompt_ids re-tokenize turn t's completion:
    the "exact prefix" property Laminar guarantees by construction holds there only when
    the template happens to reproduce it (prime-rl merges steps "best effort" and starts a
    new sample where it breaks).
  * the episode's state lives inside the running `rollout()` call (an in-process State
    dict), so a rollout that dies or is repacked mid-episode cannot resume it elsewhere.

What would fit: a MultiTurnEnv's per-turn hook (`env_response(messages, state)` ->
messages) wrapped as a Laminar `Environment.step`, rendered by our TurnTemplate; that
needs only verifiers' message-level API, but bypasses its rollout loop and rubric-time
state, so it is left to a follow-up.
"""
