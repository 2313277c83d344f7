"""The rollout side: rollout workers that generate groups with behavior log-probs through an engine (worker.py;
engines/: hf, dppo's own sampler, and vllm) and the replay buffer that hands them to the trainer under the staleness
limit (replay_buffer.py). Between the two, each way the data travels is written once:

    buffer_client.py  the worker loop (run_ticket: acquire -> load -> seed -> generate -> put) over a BufferClient,
                      and the in-process client (trainer.mode=sync without Ray)
    buffer_server.py  the replay buffer served to workers and the trainer (BufferServer; ReplayBufferActor on Ray)
    ray_worker.py     the Ray actor and its client (the buffer actor, Ray's object store)
    process.py        the local worker process and both ends of its pipe (shared-memory weights, a shared counter)

The package imports none of them: the replay buffer's Ray process imports only buffer_server.py and
replay_buffer.py, which import neither torch nor the worker's model code (transformers): they would cost it seconds
of start-up and about 400 MB of memory it never uses (groups reach it as numpy arrays)."""
