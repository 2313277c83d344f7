"""rollout.partial_rollout on the vllm engine (runs in .venv-vllm: make test-vllm): requests aborted at a decode chunk's
end, the newer weights loaded, and each unfinished row resumed as prompt + its tokens so far. The tokens before the
change are those of an engine without it, with their log-probs; the log-probs after it are the new weights'
(a teacher-forced forward of the trainer's, within 1e-4 in fp32); finished rows are not touched."""

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from dppo.models import response_log_probs, tiny_model_config  # noqa: E402
from dppo.workers.rollout.engines.vllm import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.vllm

TEMPERATURE, EOS, PAD, CHUNK, NEW_TOKENS = 0.9, 3, 0, 4, 14
CONFIG = tiny_model_config(
    vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
)
PROMPTS = [np.arange(4, 14), np.arange(5, 12), np.array([20, 21, 22])]
N = 4


def _model(seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(CONFIG).eval()


def _teacher_forced(model, samples) -> torch.Tensor:
    """log pi (B, R) of each row's response under model (0 past its end): the trainer's function, row by row."""
    out = torch.zeros_like(samples.behav_logp)
    for row in range(samples.responses.shape[0]):
        length = int(samples.response_mask[row].sum())
        ids = torch.cat([torch.as_tensor(PROMPTS[row // N]), samples.responses[row, :length]])[None]
        with torch.no_grad():
            out[row, :length] = response_log_probs(model, ids, length, TEMPERATURE, micro_batch_size=8)[0]
    return out


@pytest.fixture(scope="module")
def engine():
    eng = VLLMEngine(CONFIG, "float32", TEMPERATURE, NEW_TOKENS, EOS, PAD, max_num_seqs=16, partial_chunk=CHUNK)
    yield eng
    eng.close()


def test_a_response_resumed_across_a_weight_change_keeps_its_prefix_and_takes_the_new_weights_log_probs(engine):
    old = _model(0)
    new = copy.deepcopy(old)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    engine.load_weights(old.state_dict())
    engine.seed(11)
    plain = engine.sample(PROMPTS, N, version=3)  # vLLM's own generate, no change
    engine.seed(11)
    stepped = engine.sample(PROMPTS, N, version=3, refresh=lambda: None)  # driven step by step, nothing newer
    assert torch.equal(stepped.responses, plain.responses)
    torch.testing.assert_close(stepped.behav_logp, plain.behav_logp, rtol=0, atol=1e-6)
    assert (stepped.versions == 3).all()

    polls = []

    def refresh():
        polls.append(1)
        if len(polls) != 2:
            return None

        def load() -> int:
            engine.load_weights(new.state_dict())
            return 5

        return load

    engine.seed(11)
    samples = engine.sample(PROMPTS, N, version=3, refresh=refresh)
    engine.load_weights(old.state_dict())  # as the module's other tests expect
    t = 2 * CHUNK  # the second poll: after 8 decode steps, 8 tokens per row still running
    ended = plain.response_mask.sum(1) <= t  # rows that had ended by then
    assert 0 < int(ended.sum()) < len(ended), "the case needs both finished and unfinished rows at the change"
    assert torch.equal(samples.responses[:, :t], plain.responses[:, :t])
    torch.testing.assert_close(samples.behav_logp[:, :t], plain.behav_logp[:, :t], rtol=0, atol=1e-6)
    assert torch.equal(samples.responses[ended], plain.responses[ended])  # finished rows: not touched
    mask, running = samples.response_mask, ~ended
    assert (samples.versions[ended][mask[ended]] == 3).all()  # every token of a finished row: the old version
    assert (samples.versions[running, :t] == 3).all() and (samples.versions[running, t:][mask[running, t:]] == 5).all()
    # each token's log-prob: the weights that sampled it, as the trainer's forward computes it
    after = samples.response_mask.clone()
    after[:, :t] = False
    assert after.any()
    new_logp, old_logp = _teacher_forced(new, samples), _teacher_forced(old, samples)
    before = samples.response_mask.clone()
    before[:, t:] = False
    assert (samples.behav_logp - old_logp)[before].abs().max() <= 1e-4
    assert (samples.behav_logp - new_logp)[after].abs().max() <= 1e-4
    assert (old_logp - new_logp)[after].abs().max() > 1e-2  # the weights did differ there
