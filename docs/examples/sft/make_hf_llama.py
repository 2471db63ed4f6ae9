"""A small random HuggingFace Llama with a given tokenizer, saved as a model directory:
it stands for a released model in docs/finetuning.md's workflow (nothing is downloaded).

    python docs/examples/sft/make_hf_llama.py TOKENIZER_DIR OUT_DIR

Its shape is configs/sft.yaml's model (hidden 128, 4 layers, 4 heads of which 2 key/value,
RoPE, SwiGLU, untied output), so that config fine-tunes it as it is; its vocabulary is the
tokenizer's, padded to a multiple of 128 as mtcore pads it.
"""

import sys

import torch
import transformers


def main(tokenizer_dir: str, out_dir: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = -(-len(tokenizer) // 128) * 128
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"{out_dir}: a random Llama of {sum(p.numel() for p in model.parameters()):,} "
          f"parameters with the tokenizer of {tokenizer_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
