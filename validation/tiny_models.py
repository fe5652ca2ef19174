"""Tiny random-weight Qwen3 checkpoints for running a real vLLM without downloading a model.

    python -m agentspec_sim.validation.tiny_models OUT_DIR [--untied] [--seed 0]

A folder vLLM loads like any Hugging Face checkpoint: config.json, model.safetensors (bf16) and the
bundled Qwen3 tokenizer (tokenizer.json, tokenizer_config.json), so trace token ids mean the same
text. Two variants, because they exercise speculative decoding differently:
- tied embeddings (the default): greedy decoding quickly falls into repeating loops, so n-gram and
  suffix drafts are long and mostly accepted;
- untied (`--untied`): near-random next tokens, few drafts and partial acceptance.

Shape (`TINY`): hidden 128, 2 layers, 4 query heads over 2 KV heads (GQA) of dim 32, MLP 256, the
Qwen3 vocabulary padded to 151,936 as the real models are (ids past the tokenizer can be emitted), a
40,960-token context (Qwen3's). About 20 M parameters, 40–80 MB; written in a second or two.
Needs torch and transformers (both come with vLLM).
"""

from __future__ import annotations

import argparse
import lzma
import shutil
from pathlib import Path

from agentspec_sim.trace.tokenizer import tokenizer_file

TINY = {
    "vocab_size": 151936, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0, "eos_token_id": 151645, "bos_token_id": 151643,
}


def make_tiny_qwen3(out: Path, *, tied: bool = True, seed: int = 0) -> Path:
    """Write a tiny random-weight Qwen3 checkpoint to `out` (created); returns `out`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = tokenizer_file("qwen3")
    data = source.read_bytes()
    (out / "tokenizer.json").write_bytes(lzma.decompress(data) if source.suffix == ".xz" else data)
    shutil.copyfile(source.parent / "tokenizer_config.json", out / "tokenizer_config.json")
    torch.manual_seed(seed)
    config = Qwen3Config(**TINY, tie_word_embeddings=tied, torch_dtype="bfloat16")
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight Qwen3 checkpoint.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--untied", action="store_true", help="separate input and output embeddings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_qwen3(args.out, tied=not args.untied, seed=args.seed))


if __name__ == "__main__":
    main()
