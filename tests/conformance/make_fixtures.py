#!/usr/bin/env python3
"""Build the Hugging Face conformance fixtures.

For each tiny random-weight model (Qwen3-MoE, Qwen3-Next, the Qwen3.5-MoE text
model), this script
  1. trains a small byte-level BPE tokenizer and builds the model from a config
     with Hugging Face transformers (random weights, float32),
  2. records the float32 logits at every position of several prompts (one longer
     than 64 tokens),
  3. converts the model to GGUF with llama.cpp's own convert_hf_to_gguf.py
     (--outtype f32; and a q8_0 file for one model),
and writes NAME.gguf, NAME.logits (f32, little-endian, prompt after prompt) and
NAME.json (prompts, shapes, provenance) into tests/conformance/fixtures/.

A Qwen3-MoE fixture with YaRN rope scaling (qwen3moe-yarn) checks the
scaled rotary embedding read from the GGUF's rope.scaling keys.

Needs: torch, transformers==5.23.0, tokenizers, numpy, safetensors, sentencepiece,
pyyaml, and llama.cpp's converter (the llama.cpp tree vendored in the PyPI sdist of
llama-cpp-python 0.3.36; pass its path with --llama-cpp).

    python tests/conformance/make_fixtures.py --llama-cpp PATH/TO/vendor/llama.cpp
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures"
TEXT = (HERE / ".." / ".." / "crates" / "synth" / "src" / "corpus.txt").read_text()


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, Regex
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    split = Regex(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def perturb_norms(model, scale=0.1):
    # Norm weights start at exactly 1 (or 0 in the (1+w) form); perturb them so a
    # missing or doubled +1 offset shows in the logits.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def build(kind: str, vocab: int, seed: int):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096, initializer_range=0.05,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if kind == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg = Qwen3MoeConfig(num_hidden_layers=3, intermediate_size=128, norm_topk_prob=True,
                             rope_theta=1_000_000.0, tie_word_embeddings=False, **common)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3moe-yarn":
        # YaRN over a short original context (64 positions, factor 4), so the
        # ramp falls inside the rotated pairs and the prompts cross the
        # original context.
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        rope = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                "original_max_position_embeddings": 64}
        cfg = Qwen3MoeConfig(num_hidden_layers=2, intermediate_size=128, norm_topk_prob=True,
                             rope_parameters=rope, tie_word_embeddings=False,
                             **dict(common, max_position_embeddings=256))
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3moe-tied":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg = Qwen3MoeConfig(num_hidden_layers=2, intermediate_size=128, norm_topk_prob=True,
                             rope_theta=10_000.0, tie_word_embeddings=True, **common)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        cfg = Qwen3NextConfig(num_hidden_layers=4, intermediate_size=128, shared_expert_intermediate_size=32,
                              norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
                              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_conv_kernel_dim=4,
                              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                              full_attention_interval=2, tie_word_embeddings=False, **common)
        model = Qwen3NextForCausalLM(cfg)
    elif kind == "qwen35moe":
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0], "mrope_interleaved": True}
        cfg = Qwen3_5MoeTextConfig(num_hidden_layers=4, shared_expert_intermediate_size=32,
                                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                   linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                                   rope_parameters=rope, tie_word_embeddings=False, **common)
        model = Qwen3_5MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model = model.float().eval()
    perturb_norms(model)
    return model


def prompts(tok, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    texts = ["The quick brown fox jumps over the lazy dog.",
             "When the engine reads a prompt, it may compute the prompt one token at a time."]
    out = [tok(t)["input_ids"] for t in texts]
    out.append([int(x) for x in rng.integers(3, vocab, size=5)])
    out.append([int(x) for x in rng.integers(3, vocab, size=80)])  # longer than 64
    return out


def convert(llama_cpp: Path, model_dir: Path, outfile: Path, outtype: str, mtp: bool):
    wrapper = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(llama_cpp)!r}); sys.path.insert(0, {str(llama_cpp / 'gguf-py')!r})\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[1:]\n"
        f"runpy.run_path({str(llama_cpp / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    args = [sys.executable, "-c", wrapper, str(model_dir), "--outtype", outtype, "--outfile", str(outfile)]
    if mtp:
        args.append("--no-mtp")
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--only", action="append", help="build only these fixtures (repeatable)")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    tok = make_tokenizer(320)
    vocab = len(tok)
    import transformers
    for i, kind in enumerate(["qwen3moe", "qwen3moe-tied", "qwen3next", "qwen35moe", "qwen3moe-yarn"]):
        if args.only and kind not in args.only:
            continue
        model = build(kind, vocab, seed=100 + i)
        ps = prompts(tok, vocab, seed=200 + i)
        logits = []
        with torch.no_grad():
            for p in ps:
                out = model(torch.tensor([p])).logits[0].float().numpy()
                logits.append(out.astype("<f4"))
        with tempfile.TemporaryDirectory() as td:
            md = Path(td) / "model"
            model.save_pretrained(md)
            tok.save_pretrained(md)
            hybrid = kind in ("qwen3next", "qwen35moe")
            convert(args.llama_cpp, md, OUT / f"{kind}.gguf", "f32", hybrid)
            if kind == "qwen3next":
                convert(args.llama_cpp, md, OUT / f"{kind}-q8_0.gguf", "q8_0", hybrid)
        np.concatenate([x.reshape(-1) for x in logits]).tofile(OUT / f"{kind}.logits")
        meta = {
            "model": kind,
            "hf_class": type(model).__name__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "converter": "llama.cpp convert_hf_to_gguf.py (llama-cpp-python 0.3.36 sdist), --outtype f32",
            "vocab": vocab,
            "prompts": ps,
            "logits": f"{kind}.logits (f32 LE, [prompt][position][vocab])",
        }
        (OUT / f"{kind}.json").write_text(json.dumps(meta, indent=1))
        print(f"{kind}: {len(ps)} prompts, lengths {[len(p) for p in ps]}, vocab {vocab}")


if __name__ == "__main__":
    main()
