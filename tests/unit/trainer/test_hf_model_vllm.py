"""vLLM loads hf_model/ as it is and decodes greedily what transformers decodes (runs in .venv-vllm: make test-vllm;
skipped where vllm is not installed)."""

import pytest
import torch

pytest.importorskip("vllm")

from dppo.generation import sample_responses  # noqa: E402
from dppo.models import tiny_model_config  # noqa: E402
from dppo.checkpoint.hf_model import save_hf_model  # noqa: E402

pytestmark = pytest.mark.vllm
EOS, PAD = 3, 0


def test_vllm_loads_hf_model_and_decodes_greedily_as_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # head size 32: vLLM's CPU attention has no kernel below 32
    config = tiny_model_config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    out = save_hf_model(Qwen2ForCausalLM(config).eval(), tmp_path / "hf_model", eos_token=EOS, pad_token=PAD)
    prompts = torch.randint(4, 32, (3, 7), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    expected, mask = sample_responses(hf, prompts, 8, 0.0, None, EOS, PAD)

    llm = LLM(
        model=str(out),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.5,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[EOS], detokenize=False)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=row.tolist()) for row in prompts], params)
    finally:  # its engine-core process, stopped now rather than force-killed at the interpreter's exit
        llm.llm_engine.engine_core.shutdown()
    for row, output in enumerate(outputs):
        length = int(mask[row].sum())
        assert list(output.outputs[0].token_ids) == expected[row, :length].tolist(), row
