"""Saving and resuming: checkpoints as verified directories (store.py), what they hold (layout.py; the loop's state is
dppo.trainer.state's, which turns itself into trainer.pt's plain layout), a run's checkpoints (run.py), what to do
when one cannot be written (failure.py), the policy as a transformers directory (hf_model.py) and a checkpoint read
back as a policy (export.py)."""
