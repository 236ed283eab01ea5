"""`--load-format dummy`: a model of a Hugging Face `config.json`'s shape with random weights, for benchmarking at
real sizes with no download.

The weights are drawn on the target device directly, one tensor at a time (nothing of the model's size goes
through host memory), with a small standard deviation so activations stay finite through every layer. When
config.json has a 4-bit `quantization_config` (AWQ / GPTQ style: `bits: 4`, `group_size`, default 128), the layer
matrices are random 4-bit blocks (`Q4Blocks`: q in 0..15, a scale and an offset per group) that the model keeps
packed, so no dense copy of them ever exists. The tokenizer is byte-level over the config's vocabulary size (the
256 byte symbols, then filler entries `<|dummy_N|>` that encoding never produces), with no end-of-turn id so a
generation always runs to max_tokens, and the chat template is a plain "role: content" one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.formats.quant_linear import Q4Blocks
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.loaders.tokenizer import Tokenizer

from .config import ModelConfig
from .registry import architecture

INIT_STD = 0.02  # the usual initializer range: with unit-weight norms the residual stream stays O(1)
DUMMY_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")


def read_config_json(path: Path) -> dict[str, Any]:
    """The config.json dict of a `--load-format dummy` model: the file itself, or a folder's config.json."""
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{file} not found: --load-format dummy needs a Hugging Face config.json") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file} is not a readable JSON config: {e}") from None


def int4_group_size(cfg: dict[str, Any]) -> int | None:
    """The group size when config.json asks for 4-bit weights (`quantization_config.bits == 4`), else None."""
    q = cfg.get("quantization_config") or {}
    if int(q.get("bits", q.get("w_bit", 0)) or 0) != 4:
        return None
    return int(q.get("group_size", q.get("q_group_size", 128)) or 128)


def top_shapes(config: ModelConfig, embed: str = "model.embed_tokens.weight",
               norm: str = "model.norm.weight") -> dict[str, tuple[int, ...]]:
    """The names and shapes of the token embedding, the final norm and (untied) the LM head."""
    shapes = {embed: (config.vocab_size, config.hidden_size), norm: (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def attention_shapes(config: ModelConfig, prefix: str, out: str = "o_proj") -> dict[str, tuple[int, ...]]:
    """The names (under `prefix`) and shapes of a GQA layer's q/k/v/`out` projections."""
    c, h = config, config.hidden_size
    return {prefix + "q_proj.weight": (c.q_size, h), prefix + "k_proj.weight": (c.kv_size, h),
            prefix + "v_proj.weight": (c.kv_size, h), prefix + f"{out}.weight": (h, c.q_size)}


def llama_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF Llama names and shapes of `config`'s tensors (MoE experts fused as transformers 5 stores them; an
    architecture's own layer tensors from its package's `dummy_layer_shapes`)."""
    c = config
    shapes = top_shapes(c)
    own_layer = getattr(architecture(c.architecture).part("model"), "dummy_layer_shapes", None)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes.update(attention_shapes(c, p + "self_attn."))
        if own_layer is not None:  # the architecture's own names (gpt-oss's, edgeserve.models.archs.gpt_oss)
            shapes.update(own_layer(c, p))
        elif c.is_moe:  # a router and every expert as one 3-D tensor (transformers 5's fused names)
            e, f = c.num_experts, c.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, c.hidden_size)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * f, c.hidden_size)
            shapes[p + "mlp.experts.down_proj"] = (e, c.hidden_size, f)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            for x, n in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                shapes[p + f"self_attn.{x}_proj.bias"] = (n,)
        if c.qk_norm:  # per head, or (OLMo 2) over the whole projection
            shapes[p + "self_attn.q_norm.weight"] = (c.q_size if c.qk_norm_full else c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.kv_size if c.qk_norm_full else c.head_dim,)
        if c.post_norms:  # OLMo 2: its norm after the MLP (the one after attention is post_attention_layernorm)
            shapes[p + "post_feedforward_layernorm.weight"] = (c.hidden_size,)
    return shapes


class DummyWeights:
    """A WeightSource of random tensors in HF Llama naming for `config` (drawn on `device`, seeded)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 int4_group: int | None = None, seed: int = 0, std: float = INIT_STD) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype  # random dense tensors are drawn in this dtype (the model's), never in float32 first
        self.int4_group = int4_group
        self.std = std
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        model = architecture(config.architecture).part("model")
        own = getattr(model, "dummy_shapes", None)  # an architecture whose names are not Llama's (Gemma 4)
        self.shapes = own(config) if own is not None else llama_shapes(config)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def is_int4(self, name: str) -> bool:
        """Whether `name` is drawn as 4-bit blocks (the layer matrices of an int4 config)."""
        return (self.int4_group is not None and name.startswith("model.layers.") and name.endswith("proj.weight")
                and self.shapes[name][1] % self.int4_group == 0)

    def get(self, name: str, keep_int4: bool = True):
        if name not in self.shapes:
            raise KeyError(name)
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.float32, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.is_int4(name):
            blocks = self.q4_blocks(shape)
            return blocks if keep_int4 else blocks.dequantize()
        w = torch.empty(shape, dtype=self.dtype, device=self.device)
        return w.normal_(0.0, self.std, generator=self.generator)

    def q4_blocks(self, shape: tuple[int, ...]) -> Q4Blocks:
        """Random 4-bit blocks whose weights are about N(0, std) in scale: q uniform in 0..15, w = (q - 7.5) * s."""
        n, k = shape
        g = self.int4_group
        assert g is not None
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=self.device, generator=self.generator)
        scale = torch.empty(n, k // g, device=self.device).uniform_(0.5, 1.5, generator=self.generator)
        scale *= self.std / 4.6  # the std of (q - 7.5) for uniform q in 0..15 is about 4.6
        return Q4Blocks(q, scale, -7.5 * scale, g)


def weight_bytes(config: ModelConfig, dtype: torch.dtype, int4_group: int | None = None) -> int:
    """Bytes of the model's weights on the device as edgeserve keeps them on a GPU: the layer matrices dense in
    `dtype`, or 4-bit packed (half a byte per weight + a scale and an offset per group in `dtype`); MoE experts dense
    in `dtype`; norms in float32; embeddings (and an untied output head) dense in `dtype`."""
    c = config
    e = torch.empty((), dtype=dtype).element_size()
    matrices = [(c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size)]
    if not c.is_moe:
        matrices += [(2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    per_layer = 0
    if c.is_moe:  # experts dense in `dtype`, a float32 router
        per_layer += c.num_experts * (3 * c.moe_intermediate_size * c.hidden_size * e + c.hidden_size * 4)
    for n, k in matrices:
        if int4_group is not None and k % int4_group == 0:
            per_layer += n * k // 2 + 2 * n * (k // int4_group) * e
        else:
            per_layer += n * k * e
    per_layer += 2 * c.hidden_size * 4
    if c.attention_bias:
        per_layer += (c.q_size + 2 * c.kv_size) * e
    if c.qk_norm:
        per_layer += 2 * c.head_dim * 4
    tables = c.vocab_size * c.hidden_size * e * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * per_layer + tables + c.hidden_size * 4


def dummy_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer with `vocab_size` ids: the 256 byte symbols first, filler entries after them."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<|dummy_{i}|>"] = i
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, vocab_size=vocab_size)


def _byte_of(ch: str) -> int:
    """The byte a GPT-2 byte-level symbol stands for."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def dummy_chat_template() -> ChatTemplate:
    return ChatTemplate(DUMMY_TEMPLATE)
