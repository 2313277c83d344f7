"""The rollout side, each piece a plain class wrapped by a thin Ray actor: rollout workers that generate groups
with behavior log-probs through an engine (worker.py; engines/: hf, dppo's own sampler, and vllm) and the replay
buffer that hands them to the trainer under the staleness limit (replay_buffer.py).

The package imports neither module: the replay buffer's Ray process imports only replay_buffer.py, which imports
neither torch nor the worker's model code (transformers): they would cost it seconds of start-up and about 400 MB
of memory it never uses (groups reach it as numpy arrays)."""
