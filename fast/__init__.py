"""The exact speed-ups: each computes what a plain twin on the reading path computes, only faster, and the tests hold
it to that twin. A first reader skips this folder.

    logprobs.py          per-token log-probs through a chunked output layer   (twin: a plain log-softmax)
    decode.py            one decoding step of the batch, grouped-query attention on the cache, the draw
    engine.py            batched decoding, each episode's KV cache kept in its slot across turns
    pool.py              the cache's slots, one pool per process, kept across rollouts
    cuts.py              the norms and the rotary embedding in fewer kernels, bitwise the model's
    graphs.py            the decoding step over fixed buffers by bucket, replayed as CUDA graphs
                                                                      (twin: the eager step, decode.decode_step)
    batched_rollout.py   many episodes at once over the engine, users answered from their own thread
                                                                      (twin: rollout.reference_rollout)
    userloop.py          the user simulator's thread, where its requests run while the batch decodes
    opening.py           a group's opening through the policy once in the update   (twin: each episode whole)
    deadlines.py         every tool call under a deadline, tried first on a copy of its session in a probe process

Nothing here imports plumbing/ or an entry point (tests/test_layout.py)."""
