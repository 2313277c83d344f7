"""DCP's failures as dppo reports them: a write error is one ShardedCheckpointError naming each rank's error; a stop
signal that arrived while a rank in the trainer's own process was writing stays the stop it is."""

import signal

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from dppo.stopping import Stopped
from dppo.checkpoint.shards import ShardedCheckpointError, dcp_errors


def test_a_write_error_is_one_line_per_rank():
    failures = {0: (OSError(28, "No space left on device"), None)}
    with pytest.raises(
        ShardedCheckpointError,
        match=r"writing the checkpoint '/x' failed: rank 0: OSError: "
        r"\[Errno 28\] No space left on device",
    ):
        with dcp_errors("writing the checkpoint", "/x"):
            raise CheckpointException("failed", failures)


def test_a_stop_signal_during_a_write_is_raised_as_the_stop():
    with pytest.raises(Stopped) as info:
        with dcp_errors("writing the checkpoint", "/x"):
            raise CheckpointException("failed", {0: (Stopped(signal.SIGTERM), None)})
    assert info.value.signum == signal.SIGTERM
