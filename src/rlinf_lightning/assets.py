"""Tiny, locally built model assets: a character tokenizer, a small Qwen2 and a small π0.

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


@dataclass
class TinyPi0Config:
    """Shape of the tiny π0 (``transformers``' ``PI0Config``): a PaliGemma of one Gemma layer over
    one SigLIP layer, and an action expert of one Gemma layer. The expert reads the VLM's KV cache,
    so its layers, key/value heads and head size are the VLM's. The real ``pi0_base``: Gemma 2 B
    (hidden 2048, 18 layers, 8 heads, 1 KV head of 256), SigLIP So400m/14 at 224 px (27 layers,
    256 image tokens), a 300 M expert (hidden 1024, 18 layers), chunks of 50, 32-d states/actions."""

    text_hidden: int = 32
    expert_hidden: int = 16
    num_layers: int = 1
    num_heads: int = 2
    head_dim: int = 16
    image_size: int = 32
    patch_size: int = 8
    chunk_size: int = 8
    max_state_dim: int = 32
    max_action_dim: int = 8
    seed: int = 0


def build_tiny_pi0(path: str | Path, cfg: TinyPi0Config | None = None) -> Path:
    """Build a randomly initialised ``PI0ForConditionalGeneration`` (with the character tokenizer;
    the image token is the id after the vocabulary, as PaliGemma's) and ``save_pretrained`` it to
    ``path``: what ``Pi0Policy(model_path=path)`` loads, as it would a converted ``pi0_base``."""
    import torch
    from transformers import PI0Config, PI0ForConditionalGeneration, PreTrainedTokenizerFast

    cfg = cfg or TinyPi0Config()
    path = Path(path)
    build_char_tokenizer(path)
    vocab = len(PreTrainedTokenizerFast.from_pretrained(path))
    gemma = {"model_type": "gemma", "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
             "num_key_value_heads": 1, "head_dim": cfg.head_dim, "vocab_size": vocab}  # fmt: skip
    config = PI0Config(
        vlm_config={
            "model_type": "paligemma",
            "text_config": {
                **gemma,
                "hidden_size": cfg.text_hidden,
                "intermediate_size": 2 * cfg.text_hidden,
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": cfg.text_hidden,
                "intermediate_size": 2 * cfg.text_hidden,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "patch_size": cfg.patch_size,
                "image_size": cfg.image_size,
                "vision_use_head": False,
            },  # fmt: skip
            "projection_dim": cfg.text_hidden,
            "image_token_id": vocab,
            "vocab_size": vocab,
        },
        dit_config={**gemma, "hidden_size": cfg.expert_hidden, "intermediate_size": 2 * cfg.expert_hidden},
        chunk_size=cfg.chunk_size,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
    )
    torch.manual_seed(cfg.seed)
    PI0ForConditionalGeneration(config).save_pretrained(path)
    (path / "rlinf_asset.json").write_text(json.dumps({"kind": "tiny_pi0", **asdict(cfg)}, indent=1))
    return path


def is_model_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a ``from_pretrained``-loadable model (a config.json at least)."""
    return (Path(path) / "config.json").is_file()
