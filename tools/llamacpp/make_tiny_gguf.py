"""Write a tiny random-weight llama GGUF that the real `llama-server` loads and serves.

Owns: the model's shape and its tokenizer vocabulary. Its text is gibberish, but
everything Seawall reads from an engine is real: tokens are counted by llama.cpp's own
tokenizer, slots fill and free, `/metrics`, `/slots` and `/health` answer as in production.
Must not download anything: weights come from a seeded generator, the vocabulary is built
here.

    python tools/llamacpp/make_tiny_gguf.py OUT.gguf [--layers N --embd N --ff N --seed N]

The vocabulary is the smallest real one llama.cpp accepts: a SentencePiece (`llama`) vocab
of `<unk>`, `<s>`, `</s>` and the 256 byte-fallback tokens `<0x00>`..`<0xFF>`. Any text
tokenizes (one token per UTF-8 byte; SentencePiece's `▁` for a space is three bytes), and
detokenizing random bytes gives incomplete UTF-8 now and then, which llama-server holds
back until the character completes: streamed chunks are fewer than tokens, as with real
models and multi-byte text. Without a chat template in the file, llama-server uses ChatML.

The default shape (4 layers, 512 wide, 14M parameters, 55 MB of f32) is sized for speed,
not quality: one llama-server thread decodes about 300 tokens/s, ~80 per slot with four
busy, the pace of a real engine. A much smaller model streams thousands of tokens a
second, which costs the gateway and the test client more CPU than the engine itself.

Sampling `</s>` would end a stream early at random; start llama-server with `--ignore-eos`
so that every request runs to `max_tokens`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

N_SPECIAL = 3  # <unk>, <s>, </s>: SentencePiece's ids 0, 1, 2
VOCAB_SIZE = N_SPECIAL + 256


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        *([gguf.TokenType.BYTE] * 256),
    ]
    return tokens, scores, [int(t) for t in types]


def write(
    path: Path,
    *,
    n_layer: int = 4,
    n_embd: int = 512,
    n_ff: int = 1536,
    n_head: int = 4,
    n_ctx_train: int = 8192,
    seed: int = 13,
) -> Path:
    if n_embd % n_head:
        raise ValueError("n_embd must be a multiple of n_head")
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        # Small weights keep activations finite through RMS norm and softmax.
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("seawall-tiny-random")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, scores, types = vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    # numpy shapes are ggml's reversed: ggml {n_embd, n_vocab} is numpy (n_vocab, n_embd).
    # No `output.weight`: llama.cpp ties the output projection to the token embedding.
    writer.add_tensor("token_embd.weight", weight(VOCAB_SIZE, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--ff", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args(argv)
    write(args.out, n_layer=args.layers, n_embd=args.embd, n_ff=args.ff, seed=args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
