"""Answer a chat prompt with a HuggingFace base model and a PEFT adapter that
`mtcore convert to-hf ... --adapter` wrote, and check the merged export agrees.

    python docs/examples/sft/peft_answer.py BASE_DIR ADAPTER_DIR MERGED_DIR "What is 2 + 3?"

BASE_DIR: the transformers model the LoRA run's base was imported from; ADAPTER_DIR:
the PEFT adapter; MERGED_DIR: `mtcore convert to-hf` of the same checkpoint without
--adapter (base + adapters in one model). The prompt is rendered by the tokenizer's chat
template; the script prints the answer and exits 1 if the two models' logits differ.
"""

import sys

import torch
import transformers
from peft import PeftModel


def main(base_dir: str, adapter_dir: str, merged_dir: str, prompt: str) -> int:
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged_dir)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        difference = (adapted(**inputs).logits - merged(**inputs).logits).abs().max().item()
        generated = adapted.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(generated[0, inputs["input_ids"].shape[1] :])
    print(f"answer: {answer.split(tokenizer.eos_token)[0]!r}")
    print(f"base + PEFT adapter against the merged export: max |logit difference| {difference:.1e}")
    return 0 if difference < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
