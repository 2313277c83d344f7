"""`dppo import-gguf`: a tiny random Llama with SmolLM2's architecture, written as GGUF here (tests/tiny_gguf.py),
becomes a transformers directory whose model computes the GGUF-loaded model's logits bitwise in fp32, whose bf16
weights are the fp32 ones rounded, with the tokenizer and chat template; bad inputs are one line each."""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny_gguf import HIDDEN, KV_HEADS, write_gguf_of_architecture, write_tiny_smollm_gguf

from dppo.cli import main


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_smollm_gguf(tmp_path_factory.mktemp("gguf") / "tiny-smollm2.Q4_1.gguf")


def gguf_loaded(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def imported(gguf_file: Path, out: Path, *flags: str):
    assert main(["import-gguf", str(gguf_file), str(out), *flags]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    return model.eval(), transformers.AutoTokenizer.from_pretrained(str(out))


CHAT = [{"role": "user", "content": "Calculate 12 + 7."}]


def test_the_imported_model_computes_the_gguf_models_logits_bitwise_in_fp32(gguf_file, tmp_path, capsys):
    reference, reference_tokenizer = gguf_loaded(gguf_file)
    model, tokenizer = imported(gguf_file, tmp_path / "out")
    printed = capsys.readouterr().out
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert f"{params:,} parameters in float32" in printed and "model.safetensors" in printed

    # SmolLM2's shape family: llama, grouped-query attention, a tied lm_head
    config = model.config
    assert (config.model_type, config.num_key_value_heads, config.hidden_size) == ("llama", KV_HEADS, HIDDEN)
    assert config.num_key_value_heads < config.num_attention_heads and config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # written once, under the embedding's name
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}

    ids = torch.randint(0, config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name

    # the tokenizer, its chat template and special tokens, and the generation config come along
    text = reference_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == text
    assert text.endswith("<|im_start|>assistant\n") and "named SmolLM" in text
    assert tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 2


def test_bfloat16_weights_are_the_fp32_weights_rounded_to_bf16(gguf_file, tmp_path):
    reference, _ = gguf_loaded(gguf_file)
    model, _ = imported(gguf_file, tmp_path / "out", "--dtype", "bfloat16")
    assert model.config.dtype == torch.bfloat16
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert state[name].dtype == torch.bfloat16, name
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t) for t in reference.state_dict().values())


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("dppo: error:")]
    assert len(errors) == 1 and err[-1] == errors[0] and not any("Traceback" in line for line in err), err
    return errors[0]


def not_a_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_text('{"this": "is json"}')
    return path


@pytest.mark.parametrize("case, fragment", [
    (lambda tmp: tmp / "no_such.gguf", "does not exist; expected a GGUF model file"),
    (lambda tmp: tmp, "is a directory; expected a GGUF model file"),
    (not_a_gguf, "is not a GGUF file (it starts with b'{\"th'"),
    (lambda tmp: write_gguf_of_architecture(tmp / "other.gguf", "nosucharch"), "cannot load it as a causal LM"),
])  # fmt: skip
def test_a_bad_source_is_one_line_with_exit_code_6(case, fragment, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    src = case(tmp_path / "in")
    assert main(["import-gguf", str(src), str(tmp_path / "out")]) == 6
    line = one_error_line(capsys)
    assert str(src) in line and fragment in line, line
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_is_not_empty_is_replaced_only_with_force(gguf_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["import-gguf", str(gguf_file), str(out)]) == 3
    assert "exists and is not empty; pass --force to replace it" in one_error_line(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["import-gguf", str(gguf_file), str(out), "--force"]) == 0
    assert "keep.txt" not in {p.name for p in out.iterdir()} and (out / "model.safetensors").is_file()


def test_a_write_that_fails_leaves_no_out_dir_and_no_staging(gguf_file, tmp_path, capsys, monkeypatch):
    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", full_disk)
    assert main(["import-gguf", str(gguf_file), str(tmp_path / "out")]) == 3
    assert "cannot write" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_without_the_gguf_extra_it_is_one_line_naming_the_extra(gguf_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    assert main(["import-gguf", str(gguf_file), str(tmp_path / "out")]) == 2
    assert "pip install 'dppo[gguf]'" in one_error_line(capsys)
