"""``rlinf export``: a checkpoint written as the fit loop writes it becomes a ``from_pretrained``
directory whose logits are the checkpoint's policy's (full fine-tuning and LoRA merged), with the
tokenizer, chat template and generation config of the policy's model directory; bad inputs are
one line and exit status 2."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlinf_lightning.cli import main
from rlinf_lightning.policies.lora import ALL_LINEAR, LoRA
from rlinf_lightning.testing import checkpoint_one_update


def _logits(model: torch.nn.Module, tok, text: str) -> torch.Tensor:
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("lora", [None, LoRA(rank=4, alpha=8)], ids=["full", "lora"])
def test_the_exported_directory_computes_the_checkpoints_logits(assets, tmp_path, lora):
    actor = checkpoint_one_update(assets["sft"], assets, tmp_path, lora)
    out = tmp_path / "exported"
    assert main(["export", f"--ckpt_path={tmp_path / 'checkpoints' / 'last'}", f"--output_dir={out}"]) == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    trained = _logits(actor.engine.policy.model, tok, "What is 12+30?=")
    # full fine-tuning: the same tensors; LoRA: W + s B A rounded once in float32
    torch.testing.assert_close(_logits(exported, tok, "What is 12+30?="), trained, atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(str(assets["sft"]))
    assert (_logits(base, tok, "What is 12+30?=") - trained).abs().max() > 1e-3  # the update changed it
    assert not any(f.name.startswith(".tmp-") for f in tmp_path.iterdir())


@pytest.mark.slow  # about 40 s on a quiet box: a rollout, an update and two loads of a 135 M model
def test_a_lora_export_of_smollm2_keeps_its_tied_head_chat_template_and_end_token(
    smollm2_dir, assets, tmp_path
):
    """The real model: all-linear adapters beside an lm head tied to the embedding, a BPE tokenizer
    with a ChatML template, ``<|im_end|>`` as end token in its generation config."""
    actor = checkpoint_one_update(
        smollm2_dir, assets, tmp_path, LoRA(rank=4, alpha=8, target_modules=[ALL_LINEAR])
    )
    out = tmp_path / "exported"
    assert main(["export", f"--ckpt_path={tmp_path}", f"--output_dir={out}"]) == 0  # the run directory
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == 2
    tok, source = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(smollm2_dir))
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == source.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in text
    # merged weights (W + BA) against the adapters beside W: float32 rounding through 30 layers,
    # measured up to 1.6e-4 (1e-4 failed)
    torch.testing.assert_close(
        _logits(exported, tok, text), _logits(actor.engine.policy.model, tok, text), atol=1e-3, rtol=0
    )


def _fail(capsys, *args: str) -> str:
    capsys.readouterr()  # what came before (loading bars)
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_bad_exports_are_one_line_before_anything_is_written(assets, tmp_path, capsys):
    checkpoint_one_update(assets["sft"], assets, tmp_path, LoRA(rank=4, alpha=8))
    ckpt = tmp_path / "checkpoints" / "iter-000001"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert "--output_dir" in _fail(capsys, f"--ckpt_path={ckpt}", f"--output_dir={busy}")
    assert (busy / "keep.txt").read_text() == "x"
    assert "no such checkpoint" in _fail(capsys, f"--ckpt_path={tmp_path / 'nope'}", "--output_dir=x")
    # adapters exported onto another base than they were trained on
    err = _fail(
        capsys, f"--ckpt_path={ckpt}", f"--output_dir={tmp_path / 'o'}", f"--model_path={assets['base']}"
    )
    assert "trained on base" in err and "--model_path" in err
    # the recorded base moved away
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["policy"]["init_args"]["model_path"] = str(tmp_path / "moved")
    (ckpt / "state.json").write_text(json.dumps(state))
    err = _fail(capsys, f"--ckpt_path={ckpt}", f"--output_dir={tmp_path / 'o'}")
    assert "policy.model_path" in err and "--model_path" in err
    assert (
        main(
            [
                "export",
                f"--ckpt_path={ckpt}",
                f"--output_dir={tmp_path / 'o'}",
                f"--model_path={assets['sft']}",
            ]
        )
        == 0
    )
    assert not (tmp_path / "x").exists()
