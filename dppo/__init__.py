"""dppo: Decoupled PPO for asynchronous RL on language models."""

__version__ = "0.1.0"
