"""A Gemma 4 assistant drafter over flat rows, reading a Gemma 4 target's K/V.

From transformers' modeling_gemma4_assistant (and llama.cpp's gemma4-assistant graph, which computes the same):
  x = pre_projection([target_embedding(token) * sqrt(target hidden) | h])     h: the target's final-normed hidden
  x -> Gemma 4 layers, each q-only: q = rope(q_norm(Wq norm(x))) attends over the target's K/V (a sliding layer
       over the target's last sliding layer's, a global one over its last global layer's), then o_proj, the
       sandwich norms, the gelu-tanh MLP and the layer scale as in archs/gemma4
  hidden = norm(x); logits = embed_tokens(hidden) (tied, no soft-capping); next h = post_projection(hidden)
Every draft of one round sits at the position of the sequence's last token (the target has not computed it yet);
the per-layer work is Gemma4Model.layer_stack's, over a view of the target's pool (engine.spec.assistant).
An HF checkpoint with `use_ordered_embeddings` (E2B / E4B) computes logits for the tokens of its top
`centroid_intermediate_top_k` centroids only (`masked_embedding.centroids` scores the hidden state against
`num_centroids` centroids; `token_ordering` lists each centroid's vocab / num_centroids tokens), the rest set below
them (each row's lowest - 1; transformers takes the whole batch's lowest, the same for one row): a draft step then
reads that many rows of the head instead of all. A GGUF from llama.cpp's converter has no such tensors (it drops
them) and its logits are the whole head's, as llama.cpp computes them.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.dispatch import linear
from edgeserve.kernels.formats.quant_linear import LinearWeight
from edgeserve.models.archs.gemma4.model import Gemma4Layer, Gemma4Model
from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.weight_loader import WeightLoader, table_rows

TARGETS = ("gemma4", "gemma4_unified")  # the architectures whose K/V an assistant reads


class Gemma4AssistantModel(Gemma4Model):
    """The drafter: Gemma4Model's layers (all KV-shared) between the two projections."""

    pre_projection: LinearWeight
    post_projection: LinearWeight

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader) -> "Gemma4AssistantModel":
        """Build the drafter from its tensors (HF names, or a gemma4-assistant GGUF's through GGUF_TOP / GGUF_LAYER)."""
        c, src, norm, matrix = config, w.source, w.tensor, w.matrix
        layers = []
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            scale = norm(p + "layer_scalar") if src.has(p + "layer_scalar") else torch.ones(1)
            layers.append(Gemma4Layer(
                input_norm=norm(p + "input_layernorm.weight"), qkv=matrix([a + "q_proj.weight"]),
                q_norm=norm(a + "q_norm.weight"), k_norm=None, o_proj=matrix([a + "o_proj.weight"]),
                post_attn_norm=norm(p + "post_attention_layernorm.weight"),
                pre_ffn_norm=norm(p + "pre_feedforward_layernorm.weight"),
                post_ffn_norm=norm(p + "post_feedforward_layernorm.weight"),
                gate_up=matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=matrix([p + "mlp.down_proj.weight"]), scale=float(scale.reshape(-1)[0]),
                head_dim=c.layer_head_dim(i), kv_heads=c.layer_kv_heads(i),
                window=None if c.is_global(i) else c.layer_windows[i],  # type: ignore[index]
                shared=True, k_eq_v=False))
        embed, lm_head = w.embed_and_head("model.embed_tokens.weight", c.tie_word_embeddings)
        model = cls(c, embed, layers, norm("model.norm.weight"), lm_head, w.dtype, w.device,
                    rope_freqs=norm("rope_freqs") if src.has("rope_freqs") else None)
        model.pre_projection = matrix(["pre_projection.weight"])
        model.post_projection = matrix(["post_projection.weight"])
        if c.head_top_centroids and src.has("masked_embedding.centroids.weight"):
            model.centroids = matrix(["masked_embedding.centroids.weight"])
            order = src.get("masked_embedding.token_ordering", keep_int4=False)
            model.token_ordering = order.to(device=w.device, dtype=torch.long)  # type: ignore[union-attr]
        return model

    centroids: LinearWeight | None = None
    token_ordering: torch.Tensor | None = None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab]: the whole head's, or with the centroid mask those of the top centroids' tokens
        (the others each row's lowest - 1)."""
        if self.centroids is None or self.token_ordering is None:
            return super().logits(hidden)
        t, k = hidden.shape[0], self.config.head_top_centroids
        scores = linear(hidden, self.centroids).float()
        clusters = self.token_ordering.view(scores.shape[1], -1)
        ids = clusters[scores.topk(k, dim=-1).indices].reshape(t, -1)  # [T, k * tokens per centroid]
        rows = table_rows(self.embed, ids.reshape(-1)).view(t, ids.shape[1], -1)
        picked = torch.bmm(rows, hidden.float()[:, :, None]).squeeze(-1)
        out = (picked.min(dim=-1, keepdim=True).values - 1.0).expand(t, self.config.vocab_size).contiguous()
        return out.scatter_(1, ids, picked)

    def native_decoder(self) -> None:
        """No fused native stack: the drafter runs per op (each matmul a native kernel on the CPU)."""
        return None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise TypeError("a Gemma 4 assistant drafts for a target model (--draft); it does not run on its own")

    @torch.inference_mode()
    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              attn: KVAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [T, vocab], the next rows' h [T, target hidden]) for rows of (the target's scaled
        embedding of a token, the target's or the previous draft's h) at `positions`, over the target's K/V (`attn`:
        a view whose layer i is the target layer this one reads)."""
        x = self.matmul_input(torch.cat([embeds.float(), hidden.float()], dim=-1))
        h = self.layer_stack(linear(x, self.pre_projection).float(), positions, attn)
        return self.logits(h), linear(h, self.post_projection).float()


def target_layers(target: ModelConfig) -> dict[bool, int]:
    """The target layer whose K/V an assistant's layers read, by kind (True: global): the target's last layer of
    that kind (which reads its kind's last K/V-keeping layer), as transformers' shared_kv_states and llama.cpp do."""
    return {kind: max(i for i in range(target.num_layers) if target.is_global(i) == kind)
            for kind in {target.is_global(i) for i in range(target.num_layers)}}


def target_mismatch(draft: ModelConfig, target: ModelConfig) -> str | None:
    """Why the assistant `draft` cannot draft for `target` (one line), or None when it can: a target that is not
    Gemma 4, another vocabulary or hidden size, or K/V heads its queries cannot read."""
    if target.architecture not in TARGETS:
        return f"a Gemma 4 assistant drafts for Gemma 4 models only, not for this {target.architecture} model"
    if draft.vocab_size != target.vocab_size:
        return (f"the Gemma 4 assistant's vocabulary ({draft.vocab_size} tokens) is not the target's "
                f"({target.vocab_size})")
    if draft.backbone_hidden_size != target.hidden_size:
        return (f"the Gemma 4 assistant was made for a target of hidden size {draft.backbone_hidden_size}, "
                f"this one has {target.hidden_size}")
    sources = target_layers(target)
    for i in range(draft.num_layers):
        src = sources.get(draft.is_global(i))
        kind = "global" if draft.is_global(i) else "sliding"
        if src is None:
            return f"the Gemma 4 assistant has {kind} layers; the target has none"
        if draft.layer_head_dim(i) != target.layer_head_dim(src) or draft.num_heads % target.layer_kv_heads(src):
            return (f"the Gemma 4 assistant's {kind} heads ({draft.num_heads} x {draft.layer_head_dim(i)}) cannot read "
                    f"the target's K/V ({target.layer_kv_heads(src)} x {target.layer_head_dim(src)})")
    return None


def model_class(config: ModelConfig) -> type[Gemma4AssistantModel]:
    """edgeserve.models.registry's hook."""
    return Gemma4AssistantModel


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of an assistant's tensors, for random weights (edgeserve.models.dummy)."""
    c, h = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
                                          "pre_projection.weight": (h, 2 * c.backbone_hidden_size),
                                          "post_projection.weight": (c.backbone_hidden_size, h)}
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        d, q = c.layer_head_dim(i), c.num_heads * c.layer_head_dim(i)
        shapes.update({a + "q_proj.weight": (q, h), a + "q_norm.weight": (d,), a + "o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                       p + "mlp.up_proj.weight": (c.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, c.intermediate_size)})
        shapes.update({p + n: (h,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                             "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")})
    return shapes
