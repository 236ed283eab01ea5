"""Split GGUF models (llama.cpp's gguf-split: NAME-00001-of-00003.gguf, ...) load from the first part's path with
tensors from every part, a missing part is a one-line error, and `pull hf.co/...:QUANT` fetches every part."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.errors import ModelLoadError
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.models.load import load_model
from edgeserve.registry import is_pulled, list_local, pull, remove, resolve
from edgeserve.registry.hf import pick_gguf, split_parts

from fake_hub import FakeHub, running
from tiny_gguf import write_tiny_llama

REPO = "acme/split-GGUF"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """The same tiny model as one file and as three parts (8 + 8 + 4 tensors)."""
    d = tmp_path_factory.mktemp("split")
    (d / "one").mkdir()
    (d / "parts").mkdir()
    single = write_tiny_llama(d / "one" / "tiny.Q8_0.gguf", qtype="Q8_0")
    first = write_tiny_llama(d / "parts" / "tiny.Q8_0.gguf", qtype="Q8_0", split_max_tensors=8)
    return single, first


def test_split_model_loads_from_its_first_part(models) -> None:
    single, first = models
    assert first.name == "tiny.Q8_0-00001-of-00003.gguf"
    g = GGUFFile(first)
    assert [p.name for p in g.parts] == [f"tiny.Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    whole = GGUFFile(single)
    assert g.tensor_names() == whole.tensor_names()
    last = whole.tensor_names()[-1]  # stored in the third part
    assert torch.equal(g.load_tensor(last), whole.load_tensor(last))
    a, b = load_model(resolve(str(single))), load_model(resolve(str(first)))
    ids = torch.tensor(b.tokenizer.encode("hello hello"))
    pos = torch.arange(len(ids))
    from edgeserve.models.attention import ContiguousKV

    def logits(lm):
        c = lm.config
        kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, lm.model.dtype)
        return lm.model.logits(lm.model.forward(ids, pos, kv))

    assert torch.equal(logits(a), logits(b))


def test_missing_or_wrong_part_is_a_one_line_error(models, tmp_path: Path) -> None:
    _, first = models
    for p in first.parent.glob("*.gguf"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(ModelLoadError, match="not the first part of a split GGUF model") as e:
        GGUFFile(tmp_path / "tiny.Q8_0-00002-of-00003.gguf")
    assert "\n" not in str(e.value)
    (tmp_path / "tiny.Q8_0-00003-of-00003.gguf").unlink()
    with pytest.raises(ModelLoadError, match=r"part 3 of 3 is missing: .*tiny\.Q8_0-00003-of-00003\.gguf$") as e:
        GGUFFile(tmp_path / first.name)
    assert "\n" not in str(e.value)


def test_pick_gguf_counts_a_split_model_once() -> None:
    files = {"m-Q8_0-00001-of-00002.gguf": 600, "m-Q8_0-00002-of-00002.gguf": 500, "m-Q4_K_M.gguf": 700}
    assert pick_gguf(files, "Q8_0") == "m-Q8_0-00001-of-00002.gguf"
    assert split_parts("m-Q8_0-00001-of-00002.gguf") == ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    assert split_parts("m-Q4_K_M.gguf") == ["m-Q4_K_M.gguf"]
    del files["m-Q4_K_M.gguf"]
    # no Q4_K_M: the smallest 4-bit one, where a split model weighs all its parts
    files.update({"Q4_0/m-Q4_0-00001-of-00002.gguf": 300, "Q4_0/m-Q4_0-00002-of-00002.gguf": 300, "m-Q4_1.gguf": 500})
    assert pick_gguf(files, None) == "m-Q4_1.gguf"


@pytest.fixture
def hub(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    single, first = models
    files = {p.name: p.read_bytes() for p in first.parent.glob("*.gguf")}
    files["tiny.Q4_0.gguf"] = single.read_bytes()
    fake = FakeHub(repos={REPO: files})
    with running(fake) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def test_pull_fetches_every_part(hub: FakeHub, models) -> None:
    _, first = models
    path = pull(f"hf.co/{REPO}:Q8_0", progress=False)
    assert path.name == first.name
    for name in split_parts(first.name):
        assert (path.parent / name).read_bytes() == (first.parent / name).read_bytes()
    assert is_pulled(f"hf.co/{REPO}:Q8_0")
    assert f"hf.co/{REPO}:Q8_0" in {s.name for s in list_local()}
    assert GGUFFile(path).tensor_names() == GGUFFile(first).tensor_names()
    (path.parent / split_parts(first.name)[2]).unlink()  # a part gone: not pulled any more
    assert not is_pulled(f"hf.co/{REPO}:Q8_0")
    path = pull(f"hf.co/{REPO}:Q8_0", progress=False)
    removed = remove(f"hf.co/{REPO}:Q8_0")
    assert {p.name for p in removed} >= set(split_parts(first.name))
    assert not path.parent.exists() or not any(path.parent.glob("*.gguf"))


def test_pull_refuses_a_split_model_with_a_part_missing(hub: FakeHub, models) -> None:
    from edgeserve.errors import PullError

    _, first = models
    del hub.repos[REPO][split_parts(first.name)[1]]
    with pytest.raises(PullError, match=r"lacks part tiny\.Q8_0-00002-of-00003\.gguf"):
        pull(f"hf.co/{REPO}:Q8_0", progress=False)


def test_size_counts_every_part(models) -> None:
    from edgeserve.server.model_manager import source_bytes

    _, first = models
    parts = sorted(first.parent.glob("*.gguf"))
    assert len(parts) == 3
    assert source_bytes(resolve(str(first))) == sum(p.stat().st_size for p in parts)
