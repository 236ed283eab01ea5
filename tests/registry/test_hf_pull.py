"""Pulling from Hugging Face: huggingface_hub for real against a local server in the Hub's URL layout."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest

from edgeserve.errors import PullError
from edgeserve.registry import hf, is_pulled, list_local, pull, remove, resolve
from edgeserve.registry.hf import parse, pick_gguf, quant_of

from fake_hub import FakeHub, running
from tiny_gguf import write_tiny_llama

REPO = "acme/tiny-GGUF"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no user token or cache in play
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("ggufs")
    files = {}
    for i, name in enumerate(["tiny.Q8_0.gguf", "tiny.Q4_K_M.gguf", "tiny.Q4_0.gguf"]):
        files[name] = write_tiny_llama(d / name, seed=i).read_bytes()
    files["README.md"] = b"# tiny\n"
    return files


@pytest.fixture
def hub(gguf_files, home, monkeypatch: pytest.MonkeyPatch):
    fake = FakeHub(repos={REPO: dict(gguf_files)})
    with running(fake) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def test_names_parse() -> None:
    assert parse("hf.co/Owner/Repo-GGUF:q4_k_m") == hf.HFRef("Owner/Repo-GGUF", True, "Q4_K_M")
    assert parse("huggingface.co/Owner/Repo") == hf.HFRef("Owner/Repo", True, None)
    assert parse("Owner/Repo") == hf.HFRef("Owner/Repo", False)
    assert parse("smollm2-135m") is None and parse("./x/y") is None and parse("a/b.gguf") is None
    assert quant_of("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("model-iq4_xs.gguf") == "IQ4_XS" and quant_of("model-f16.gguf") == "F16"


def test_pick_gguf() -> None:
    files = {"m-Q8_0.gguf": 800, "m-Q4_K_M.gguf": 500, "m-Q4_0.gguf": 450, "m-IQ4_XS.gguf": 400, "README.md": 1}
    assert pick_gguf(files, "Q8_0") == "m-Q8_0.gguf"
    assert pick_gguf(files, None) == "m-Q4_K_M.gguf"
    del files["m-Q4_K_M.gguf"]
    assert pick_gguf(files, None) == "m-IQ4_XS.gguf"  # the smallest 4-bit one
    with pytest.raises(PullError, match=r"no GGUF file for Q6_K.*m-Q8_0\.gguf \(Q8_0\)"):
        pick_gguf(files, "Q6_K")
    with pytest.raises(PullError, match="no GGUF file for a 4-bit.*m-F16.gguf"):
        pick_gguf({"m-F16.gguf": 1, "m-Q8_0.gguf": 1}, None)


def test_pull_by_quant_then_from_the_cache(hub: FakeHub, home: Path, gguf_files) -> None:
    path = pull(f"hf.co/{REPO}:Q8_0", progress=False)
    assert path.name == "tiny.Q8_0.gguf" and path.read_bytes() == gguf_files["tiny.Q8_0.gguf"]
    assert home in path.parents
    seen = len(hub.requests)
    assert pull(f"hf.co/{REPO}:Q8_0", progress=False) == path and len(hub.requests) == seen  # no network
    assert is_pulled(f"hf.co/{REPO}:Q8_0") and not is_pulled(f"hf.co/{REPO}")
    src = resolve(f"hf.co/{REPO}:Q8_0", pull_missing=False)
    assert (src.kind, src.path) == ("gguf", path)
    default = pull(f"hf.co/{REPO}", progress=False)
    assert default.name == "tiny.Q4_K_M.gguf"
    assert {s.name for s in list_local()} >= {f"hf.co/{REPO}:Q8_0", f"hf.co/{REPO}:Q4_K_M"}
    assert not (path.parent / "README.md").exists()  # only the chosen file


def test_resumed_download(hub: FakeHub, gguf_files, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    # bytes are written (and resumable) per chunk; the real chunk is bigger than this test's file
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.cut_first_get.add((REPO, "tiny.Q4_0.gguf"))
    path = pull(f"hf.co/{REPO}:Q4_0", progress=False)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(gguf_files["tiny.Q4_0.gguf"]).digest()
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/tiny.Q4_0.gguf") and r]
    assert ranges and int(ranges[0].split("=")[1].rstrip("-")) > 0  # the second GET asked for the rest only


def test_wrong_checksum_is_refused_and_deleted(hub: FakeHub) -> None:
    hub.wrong_sha256.add((REPO, "tiny.Q8_0.gguf"))
    with pytest.raises(PullError, match="checksum mismatch for tiny.Q8_0.gguf"):
        pull(f"hf.co/{REPO}:Q8_0", progress=False)
    assert not is_pulled(f"hf.co/{REPO}:Q8_0")
    assert not list((hf.parse(f"hf.co/{REPO}").folder).glob("*.gguf"))


def test_unknown_repo_and_quant_are_one_line_errors(hub: FakeHub) -> None:
    with pytest.raises(PullError, match="cannot list acme/nothing"):
        pull("hf.co/acme/nothing", progress=False)
    with pytest.raises(PullError, match=r"no GGUF file for Q6_K; the repository has: .*tiny\.Q8_0\.gguf"):
        pull(f"hf.co/{REPO}:Q6_K", progress=False)


def test_safetensors_repo_fetches_config_tokenizer_and_weights_only(hub: FakeHub, home: Path) -> None:
    files = {"config.json": json.dumps({"model_type": "llama"}).encode(), "tokenizer.json": b"{}",
             "tokenizer_config.json": b"{}", "model.safetensors": b"\0" * 64, "pytorch_model.bin": b"x" * 10,
             "README.md": b"hi", "onnx/model.onnx": b"y"}
    hub.repos["acme/tiny"] = files
    folder = pull("acme/tiny", progress=False)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == \
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert resolve("acme/tiny", pull_missing=False).kind == "hf"
    hub.repos["acme/gguf-only"] = {"x.Q4_0.gguf": b"GGUF"}
    with pytest.raises(PullError, match="not a safetensors model repository.*hf.co/acme/gguf-only"):
        pull("acme/gguf-only", progress=False)


def test_cli_pull_list_rm(hub: FakeHub, capsys: pytest.CaptureFixture) -> None:
    from edgeserve.cli import main

    name = f"hf.co/{REPO}:Q4_K_M"
    assert main(["pull", name]) == 0
    assert main(["list"]) == 0
    assert name in capsys.readouterr().out
    assert main(["rm", name]) == 0
    assert not is_pulled(name)
    capsys.readouterr()
    assert main(["list", "--all"]) == 0
    out = capsys.readouterr().out
    assert name not in out and "gemma3-270m" in out and "MB" in out
    assert main(["rm", name]) != 0  # not pulled any more: a one-line error
    err = capsys.readouterr().err
    assert "not pulled" in err and "Traceback" not in err


def test_remove_keeps_other_quants(hub: FakeHub) -> None:
    a = pull(f"hf.co/{REPO}:Q8_0", progress=False)
    b = pull(f"hf.co/{REPO}:Q4_0", progress=False)
    assert remove(f"hf.co/{REPO}:Q8_0") == [a]
    assert not a.exists() and b.exists() and is_pulled(f"hf.co/{REPO}:Q4_0")


def test_served_by_its_hf_name(hub: FakeHub) -> None:
    from edgeserve.server import ServerConfig

    from server_helpers import serve

    name = f"hf.co/{REPO}:Q8_0"
    with serve(ServerConfig(models=("smollm2-135m",), dtype="float32")) as s, \
            httpx.Client(base_url=s.url, timeout=120) as c:
        r = c.post("/api/pull", json={"model": name, "stream": False})
        assert r.status_code == 200 and r.json() == {"status": "success"}
        assert name in [m["name"] for m in c.get("/api/tags").json()["models"]]
        msg = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"model": name, "messages": msg, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["choices"][0]["message"]["role"] == "assistant"
        r = c.post("/api/chat", json={"model": name, "messages": msg, "stream": False, "options": {"num_predict": 3}})
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True
        r = c.post("/api/pull", json={"model": "hf.co/acme/missing", "stream": False})
        assert r.status_code >= 400 and "error" in r.json()


def test_catalog_short_name_pulls_from_the_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgeserve.registry import catalog

    entry = catalog.HFCatalogEntry("tiny-chat", "test", f"hf.co/{REPO}:Q4_0", 1, "MIT")
    monkeypatch.setitem(catalog.HF_CATALOG, "tiny-chat", entry)
    path = pull("tiny-chat", progress=False)
    assert path.name == "tiny.Q4_0.gguf" and is_pulled("tiny-chat")
    assert resolve("tiny-chat", pull_missing=False).path == path


def test_hf_catalog_names_are_hub_names() -> None:
    from edgeserve.registry.catalog import CATALOG, HF_CATALOG

    assert not set(HF_CATALOG) & set(CATALOG)
    for name, e in HF_CATALOG.items():
        ref = parse(e.hf)
        assert ref is not None and ref.gguf and ref.quant, name
        assert parse(name) == ref and e.approx_size_bytes > 0


def test_qwen35_entries_pick_the_q4_k_m_file_of_unsloths_naming() -> None:
    """The Qwen3.5 short names (not pulled in tests): their repos' files are named MODEL-QUANT.gguf beside dynamic
    UD-* quants and a vision projector, and the Q4_K_M text model is the one picked."""
    from edgeserve.registry.catalog import HF_CATALOG
    from edgeserve.registry.hf import pick_gguf

    for name, size in (("qwen3.5-0.8b", "0.8B"), ("qwen3.5-4b", "4B")):
        ref = parse(HF_CATALOG[name].hf)
        assert ref.repo == f"unsloth/Qwen3.5-{size}-GGUF" and ref.quant == "Q4_K_M"
        files = {f"Qwen3.5-{size}-{q}.gguf": 1 for q in ("Q4_K_M", "UD-Q4_K_XL", "Q4_K_S", "Q8_0", "BF16")}
        assert pick_gguf({**files, "mmproj-F16.gguf": 1, "mmproj-BF16.gguf": 1}, ref.quant) == (
            f"Qwen3.5-{size}-Q4_K_M.gguf")


# each short name's repository and the model file its Hub listing shows (checked when the entries were added)
_EMBEDDER_FILES = {
    "nomic-embed-text": ("nomic-ai/nomic-embed-text-v1.5-GGUF", "nomic-embed-text-v1.5.Q4_K_M.gguf"),
    "mxbai-embed-large": ("ChristianAzinn/mxbai-embed-large-v1-gguf", "mxbai-embed-large-v1.Q4_K_M.gguf"),
    "bge-m3": ("rbehzadan/bge-m3-gguf", "bge-m3-Q8_0.gguf"),
    "snowflake-arctic-embed": ("yixuan-chia/snowflake-arctic-embed-l-GGUF", "snowflake-arctic-embed-l-Q8_0.gguf"),
    "embeddinggemma": ("unsloth/embeddinggemma-300m-GGUF", "embeddinggemma-300M-BF16.gguf"),
    "qwen3-embedding-0.6b": ("Qwen/Qwen3-Embedding-0.6B-GGUF", "Qwen3-Embedding-0.6B-Q8_0.gguf"),
    "bge-reranker-v2-m3": ("gpustack/bge-reranker-v2-m3-GGUF", "bge-reranker-v2-m3-Q8_0.gguf"),
    "qwen3-reranker-0.6b": ("ggml-org/Qwen3-Reranker-0.6B-Q8_0-GGUF", "qwen3-reranker-0.6b-q8_0.gguf"),
}


@pytest.mark.parametrize("name", sorted(_EMBEDDER_FILES))
def test_embedder_and_reranker_names_resolve_to_their_hub_files(name: str) -> None:
    """Issue 36's short names (not pulled in tests) parse to their hf.co repos, and the quantization each names
    picks that repo's model file among its other quantizations."""
    from edgeserve.registry.hf import pick_gguf, quant_of

    repo, file = _EMBEDDER_FILES[name]
    ref = parse(name)
    assert ref is not None and ref.gguf and ref.repo == repo and ref.quant == quant_of(file), name
    others = {re.sub(ref.quant, q, file, flags=re.IGNORECASE): 2 for q in ("Q4_0", "Q5_K_M", "F16")
              if q != ref.quant}
    assert len(others) == 3 and file not in others
    assert pick_gguf({**others, file: 1}, ref.quant) == file


def test_a_vision_repo_pulls_its_projector_beside_the_model(gguf_files, home, monkeypatch) -> None:
    from edgeserve.registry.hf import pick_mmproj
    from edgeserve.vision.runtime import find_mmproj

    files = {"tiny.Q4_K_M.gguf": gguf_files["tiny.Q4_K_M.gguf"], "mmproj-tiny-Q8_0.gguf": b"q8" * 10,
             "mmproj-tiny-F16.gguf": b"f16" * 10}
    assert pick_mmproj({f: len(d) for f, d in files.items()}, "tiny.Q4_K_M.gguf") == "mmproj-tiny-F16.gguf"
    assert pick_mmproj({"m.Q4_K_M.gguf": 1}, "m.Q4_K_M.gguf") is None
    with pytest.raises(PullError, match="no GGUF file for F16"):  # a projector is never taken for the model
        pick_gguf({f: len(d) for f, d in files.items()}, "F16")
    with running(FakeHub(repos={"Owner/Vision-GGUF": files})) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        path = pull("hf.co/Owner/Vision-GGUF", progress=False)
    assert path.name == "tiny.Q4_K_M.gguf"
    assert find_mmproj(path) == path.parent / "mmproj-tiny-F16.gguf"
    assert (path.parent / "mmproj-tiny-F16.gguf").read_bytes() == files["mmproj-tiny-F16.gguf"]
    assert not (path.parent / "mmproj-tiny-Q8_0.gguf").exists()
    assert [s.name for s in list_local() if "Vision" in s.name] == ["hf.co/Owner/Vision-GGUF:Q4_K_M"]
