"""The vllm engine's agent completions (runs in .venv-vllm: make test-vllm): continuous batching, a request added
while others run joins the batch in flight and gets the tokens and log-probs it would get alone (teacher-forced
forward of the trainer's, within 1e-4 in fp32); each request cut at its own max_tokens; greedy ones as engine.greedy."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from dppo.models import response_log_probs, tiny_model_config  # noqa: E402
from dppo.workers.rollout.engines.base import TokenRequest  # noqa: E402
from dppo.workers.rollout.engines.vllm import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.vllm

TEMPERATURE, EOS, PAD, NEW_TOKENS = 0.9, 3, 0, 14
CONFIG = tiny_model_config(
    vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
)
PROMPTS = [tuple(range(4, 14)), tuple(range(5, 12)), (20, 21, 22)]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(CONFIG).eval()


@pytest.fixture(scope="module")
def engine(model):
    eng = VLLMEngine(CONFIG, "float32", TEMPERATURE, NEW_TOKENS, EOS, PAD, max_num_seqs=16)
    eng.load_weights(model.state_dict())
    yield eng
    eng.close()


def _teacher_forced(model, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + tokens])
    with torch.no_grad():
        return response_log_probs(model, ids, len(tokens), TEMPERATURE, micro_batch_size=1)[0]


def test_a_request_added_while_others_run_joins_them_and_samples_as_it_would_alone(engine, model):
    engine.seed(3)
    alone = engine.token_stream(version=1)
    alone.add(2, TokenRequest(PROMPTS[2], NEW_TOKENS))
    ((_, want),) = _drain(alone)

    engine.seed(3)
    stream = engine.token_stream(version=1)
    stream.add(0, TokenRequest(PROMPTS[0], NEW_TOKENS))
    stream.add(1, TokenRequest(PROMPTS[1], NEW_TOKENS))
    outputs = dict(stream.step())  # the first decode step of 0 and 1
    stream.add(2, TokenRequest(PROMPTS[2], NEW_TOKENS))  # joins the batch in flight
    assert stream.running == 3 - len(outputs)
    outputs.update(_drain(stream))
    assert sorted(outputs) == [0, 1, 2]
    assert outputs[2].token_ids == want.token_ids  # a request's seed is the ticket's and its key's: not the batch's
    for key, out in outputs.items():
        assert out.versions == [1] * len(out.token_ids)
        got = torch.tensor(out.logprobs)
        torch.testing.assert_close(got, _teacher_forced(model, PROMPTS[key], out.token_ids), rtol=0, atol=1e-4)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS else "length")


def test_complete_cuts_each_request_at_its_max_tokens_and_decodes_greedy_ones_as_greedy_does(engine):
    engine.seed(5)
    requests = [TokenRequest(PROMPTS[0], 2), TokenRequest(PROMPTS[1], NEW_TOKENS), TokenRequest(PROMPTS[2], 5, True)]
    outputs = engine.complete(requests, version=0)
    assert len(outputs[0].token_ids) <= 2
    greedy, mask = engine.greedy([np.asarray(PROMPTS[2])])
    assert outputs[2].token_ids == greedy[0][mask[0]].tolist()[:5] and outputs[2].logprobs is None
    assert outputs[1].logprobs is not None and len(outputs[1].logprobs) == len(outputs[1].token_ids)


def _drain(stream):
    out = []
    while stream.running:
        out += stream.step()
    return out
