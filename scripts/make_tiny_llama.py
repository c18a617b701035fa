#!/usr/bin/env python3
"""Build a tiny random fp32 Llama in Hugging Face format, entirely offline.

Used by ``tests/test_max_integration.py`` (and by hand, see ``docs/max.md``) to
give ``max generate --devices cpu`` a model that compiles and runs in seconds:
2 layers, hidden size 128, 4 attention heads, 2 KV heads, fp32 weights drawn
from a seeded generator, and a byte-level BPE tokenizer trained on a built-in
corpus and saved as ``PreTrainedTokenizerFast``.

Needs ``numpy``, ``safetensors``, ``tokenizers`` and ``transformers`` (all of
which ``max[serve]`` installs); no torch and no network. The output is a
pure function of ``--seed``, so two builds are byte-identical.

    python scripts/make_tiny_llama.py OUT_DIR [--seed 0] [--dtype float32|bfloat16] [--head-dim N]
                                      [--layers N] [--heads N] [--kv-heads N] [--intermediate N]
                                      [--max-positions N] [--sliding-window N]

``--dtype bfloat16`` (vLLM on CPU) rounds the same weights to bf16 and needs ``torch``;
``--head-dim`` sets the attention head size (the hidden size is heads x head size). The
geometry flags make a model whose prefill costs real time on a CPU (``scripts/bench_ttft.py``'s
MAX section); their defaults are the tests' tiny model. ``--sliding-window N`` alternates
sliding-window (``N`` tokens) and full-attention layers, as gpt-oss and Gemma do.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a persistent key value cache keeps attention pages on fast storage",
    "large language models reuse the prefix of a long prompt",
    "blocks of one hundred and twenty eight tokens are hashed and stored",
    "the store is a zarr hierarchy with one chunk per block hash",
    "load what was computed before instead of computing it again",
    "system prompts documents and multi turn chats share long prefixes",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


@dataclass(frozen=True)
class TinyLlamaShape:
    """Geometry of the generated model; the defaults are what the tests use."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    vocab_size: int = 384
    dtype: str = "float32"
    sliding_window: int = 0
    """Tokens an even-numbered layer attends to (``layer_types`` alternates sliding and full
    attention from layer 0, as gpt-oss and Gemma do); 0: full attention in every layer."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on the built-in corpus, padded to ``vocab_size``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )


def random_weights(shape: TinyLlamaShape, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Returns a Llama state dict of fp32 arrays drawn from ``seed``."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    weights = {
        "model.embed_tokens.weight": mat(vocab, h),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": mat(vocab, h),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": mat(h, h),
            p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, h),
            p + "mlp.gate_proj.weight": mat(shape.intermediate_size, h),
            p + "mlp.up_proj.weight": mat(shape.intermediate_size, h),
            p + "mlp.down_proj.weight": mat(h, shape.intermediate_size),
        }
    return weights


def hf_config(shape: TinyLlamaShape, tok: PreTrainedTokenizerFast, vocab: int) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` with this geometry."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": shape.dtype,
        "vocab_size": vocab,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    } | ({"sliding_window": shape.sliding_window,
          "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(shape.num_layers)]}
         if shape.sliding_window else {})


def build(out: Path, seed: int = 0, shape: TinyLlamaShape = TinyLlamaShape()) -> Path:
    """Writes the model directory ``out`` and returns it."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(shape.vocab_size)
    tok.save_pretrained(out)
    vocab = len(tok)
    (out / "config.json").write_text(json.dumps(hf_config(shape, tok, vocab), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id})
    )
    weights = random_weights(shape, vocab, seed)
    if shape.dtype == "float32":
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        import torch
        from safetensors.torch import save_file as save_torch

        save_torch({k: torch.from_numpy(v).to(getattr(torch, shape.dtype)) for k, v in weights.items()},
                   str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write the model into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--head-dim", type=int, default=TinyLlamaShape.hidden_size // TinyLlamaShape.num_heads,
                    help="attention head size (hidden size = heads x head size)")
    ap.add_argument("--layers", type=int, default=TinyLlamaShape.num_layers)
    ap.add_argument("--heads", type=int, default=TinyLlamaShape.num_heads)
    ap.add_argument("--kv-heads", type=int, default=TinyLlamaShape.num_kv_heads)
    ap.add_argument("--intermediate", type=int, default=TinyLlamaShape.intermediate_size)
    ap.add_argument("--max-positions", type=int, default=TinyLlamaShape.max_position_embeddings)
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="window of the even-numbered layers (sliding and full attention alternate); 0: none")
    args = ap.parse_args()
    if min(args.layers, args.heads, args.kv_heads, args.intermediate, args.max_positions, args.head_dim) < 1 \
            or args.heads % args.kv_heads or args.sliding_window < 0:
        ap.error("geometry flags must be positive (--sliding-window 0 or more), and --heads a multiple of --kv-heads")
    shape = TinyLlamaShape(num_layers=args.layers, hidden_size=args.heads * args.head_dim, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                           max_position_embeddings=args.max_positions, dtype=args.dtype,
                           sliding_window=args.sliding_window)
    print(build(args.out, args.seed, shape))


if __name__ == "__main__":
    main()
