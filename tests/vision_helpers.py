"""Tiny random vision-language models for the image tests: an HF Gemma 3 folder (transformers' own classes write
it) with a byte-level tokenizer holding Gemma's image tokens, and Pillow-made images."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tiny_gguf import byte_vocab

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>"]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' "
                  "else m.role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def byte_tokenizer(folder: Path, specials: list[str], template: str, bos: str, eos: str) -> dict[str, int]:
    """A byte-level BPE tokenizer.json + tokenizer_config.json (chat template) in `folder`; the vocabulary."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(specials + byte_vocab())}
    tok = tokenizers.Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "chat_template": template, "add_bos_token": False}))
    return vocab


def tiny_gemma3(folder: Path, seed: int = 0, image_size: int = 64, patch: int = 8, tokens: int = 4) -> Path:
    """A random Gemma 3 vision-language model (SigLIP tower, projector, 2-layer LM) saved by transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    vocab = byte_tokenizer(folder, GEMMA_SPECIALS, GEMMA_TEMPLATE, "<bos>", "<end_of_turn>")
    torch.manual_seed(seed)
    cfg = Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=len(vocab), sliding_window=64,
                         max_position_embeddings=2048),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=patch),
        mm_tokens_per_image=tokens, boi_token_index=vocab["<start_of_image>"],
        eoi_token_index=vocab["<end_of_image>"], image_token_index=vocab["<image_soft_token>"],
        bos_token_id=vocab["<bos>"], eos_token_id=vocab["<end_of_turn>"], pad_token_id=0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initializes these to zero: the image would vanish
        for name, p in model.named_parameters():
            if "mm_input_projection" in name or "soft_emb_norm" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder


def picture(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A random-pixel RGB image of that size, encoded."""
    rng = np.random.RandomState(seed)
    img = Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


SMOLVLM_SPECIALS = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
                    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
# SmolVLM's own template: it reads content only as a list of parts
SMOLVLM_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
                    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
                    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def tiny_smolvlm(folder: Path, seed: int = 0, tile: int = 32, longest: int = 64) -> Path:
    """A random SmolVLM / Idefics3 model (SigLIP tower, pixel shuffle + linear, 2-layer Llama) saved by
    transformers, its processor splitting images into `tile` squares after resizing to `longest`."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    vocab = byte_tokenizer(folder, SMOLVLM_SPECIALS, SMOLVLM_TEMPLATE, "<|im_start|>", "<end_of_utterance>")
    torch.manual_seed(seed)
    cfg = Idefics3Config(
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=len(vocab),
                         max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=tile, patch_size=8),
        scale_factor=2, image_token_id=vocab["<image>"], tie_word_embeddings=False)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    Idefics3ImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": tile}).save_pretrained(
        folder)
    return folder
