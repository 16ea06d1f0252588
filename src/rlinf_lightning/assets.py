"""Tiny, locally built model assets: a character tokenizer and a small Qwen2.

Nothing is downloaded. The tokenizer is made with ``tokenizers`` and saved as a
``PreTrainedTokenizerFast``; the model is a ``Qwen2ForCausalLM`` built from a config and saved with
``save_pretrained``. Everything downstream loads with ``from_pretrained(path)``, so pointing the same
config at a real checkpoint directory needs no code change.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"


@dataclass
class TinyModelConfig:
    """Shape of the tiny Qwen2. Head dim 64 (hidden/heads) is what vLLM's CPU attention accepts."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 256
    seed: int = 0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode table, the alphabet of byte-level BPE tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def build_char_tokenizer(path: str | Path) -> Path:
    """Save a character-level tokenizer (printable ASCII + newline + specials) to ``path``.

    It is a byte-level BPE with no merges, i.e. one token per character. That is exactly the shape
    Qwen2's tokenizer class expects, so ``AutoTokenizer`` (which picks ``Qwen2Tokenizer`` from the
    model's config), ``PreTrainedTokenizerFast`` and vLLM all tokenize identically.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    b2u = _bytes_to_unicode()
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + [b2u[ord(c)] for c in chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # decoder-only generation pads on the left
    )
    fast.save_pretrained(path)
    return path


# The non-tool part of Qwen2.5-Instruct's chat template (ChatML with a default system message).
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud."
    " You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' "
    "or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_chat_tokenizer(path: str | Path) -> Path:
    """Save a byte-level tokenizer in Qwen2.5-Instruct's layout to ``path``: ``Qwen2Tokenizer``, one
    token per byte (every UTF-8 text encodes; no merges), then ``<|endoftext|>`` (padding),
    ``<|im_start|>`` and ``<|im_end|>`` (end of a turn: the EOS a chat model stops on), and the
    ChatML chat template. What a real Qwen2.5-Instruct directory holds, 150 000 merges smaller."""
    from transformers import Qwen2Tokenizer

    path = Path(path)
    alphabet = sorted(_bytes_to_unicode().values())
    tok = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alphabet)}, merges=[], unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]})
    tok.pad_token, tok.eos_token = "<|endoftext|>", "<|im_end|>"
    tok.padding_side = "left"
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def build_tiny_qwen2(path: str | Path, cfg: TinyModelConfig | None = None, chat: bool = False) -> Path:
    """Build a randomly initialised Qwen2 (and its tokenizer) and ``save_pretrained`` it to ``path``.

    ``chat=True`` lays it out as a chat checkpoint (Qwen2.5-Instruct): the byte-level tokenizer with
    the ChatML template of :func:`build_chat_tokenizer`, EOS ``<|im_end|>`` in the configs.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    cfg = cfg or TinyModelConfig()
    path = Path(path)
    (build_chat_tokenizer if chat else build_char_tokenizer)(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    kind = "tiny_qwen2_chat" if chat else "tiny_qwen2"
    (path / "rlinf_asset.json").write_text(json.dumps({"kind": kind, **asdict(cfg)}, indent=1))
    return path


def is_model_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a ``from_pretrained``-loadable model (a config.json at least)."""
    return (Path(path) / "config.json").is_file()
