"""Write a tiny random-weight llama GGUF with llama.cpp's own ``gguf-py``.

The tokenizer comes from the tree's bundled ``models/ggml-vocab-llama-spm.gguf`` (the
llama SentencePiece vocabulary, 32,000 tokens, no tensors); the weights are random, so
the text is gibberish, but llama-server loads it, schedules it on its slots and
publishes real metrics about it. About 17 MB at the default size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: Small enough to decode quickly on a shared CPU, big enough to be a real llama graph.
N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF, N_CTX = 64, 2, 4, 2, 128, 16384


def write_tiny_llama(tree: Path, out: Path, seed: int = 0) -> Path:
    """Write the model to ``out`` from the llama.cpp source ``tree``; returns ``out``."""
    sys.path.insert(0, str(tree / "gguf-py"))
    try:
        import gguf
        import numpy as np
    finally:
        sys.path.pop(0)
    vocab = gguf.GGUFReader(tree / "models" / "ggml-vocab-llama-spm.gguf")

    def field(name: str) -> Any:
        return vocab.fields[name].contents()

    tokens: list[str] = field("tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("llmgw-poller-tiny-random-llama")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_scores(field("tokenizer.ggml.scores"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(field("tokenizer.ggml.unknown_token_id"))
    writer.add_add_bos_token(field("tokenizer.ggml.add_bos_token"))
    writer.add_add_eos_token(field("tokenizer.ggml.add_eos_token"))

    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> Any:
        # numpy (rows, cols) is GGUF ne = [cols, rows]: rows outputs of cols inputs each.
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    kv = N_EMBD // N_HEAD * N_HEAD_KV
    writer.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", ones(N_EMBD))
    writer.add_tensor("output.weight", weight(n_vocab, N_EMBD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: tiny_model.py LLAMA_CPP_TREE OUT.gguf")
    print(write_tiny_llama(Path(sys.argv[1]), Path(sys.argv[2])))
