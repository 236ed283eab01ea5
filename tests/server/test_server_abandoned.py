"""Work of a client that went away stops at the next chunk boundary: an abandoned request's remaining image
encodes and embedding sub-batches are skipped, so the next client does not wait for them."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.server import ServerConfig
from server_helpers import metric, serve, wait_until
from tiny_gguf import write_tiny_llama

pytest.importorskip("transformers")


class Gate:
    """Wraps a model function: counts the items each call gets; the first call waits until `release()`."""

    def __init__(self, fn):
        self.fn, self.items = fn, []
        self.started, self._open = threading.Event(), threading.Event()

    def __call__(self, batch):
        self.items.append(len(batch))
        self.started.set()
        assert self._open.wait(60)
        return self.fn(batch)

    def release(self) -> None:
        self._open.set()


def post_and_leave(url: str, path: str, body: dict, gate: Gate, closed_metric: str) -> None:
    """POST `body` on a raw socket, close it once the gated model call has started, and wait until the server has
    answered the gone client (its 499 counted)."""
    u = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert gate.started.wait(60)
    sock.close()
    with httpx.Client(base_url=url) as c:
        assert wait_until(lambda: metric(c.get("/metrics").text, "edgeserve_http_requests_total", closed_metric),
                          timeout=30)


def test_an_abandoned_embedding_batch_stops_at_the_next_sub_batch(tmp_path):
    model = write_tiny_llama(tmp_path / "emb.gguf", pooling_type=1)
    with serve(ServerConfig(models=(str(model),), keep_alive=None)) as s, httpx.Client(base_url=s.url,
                                                                                      timeout=60) as c:
        assert c.post("/v1/embeddings", json={"model": "emb", "input": "warm"}).status_code == 200
        engine = s.manager.entries["emb"].engine
        engine.max_batch_tokens = 8  # one input per sub-batch
        gate = engine.lm.embed = Gate(engine.lm.embed)
        inputs = [f"input number {i}" for i in range(20)]
        post_and_leave(s.url, "/v1/embeddings", {"model": "emb", "input": inputs}, gate,
                       'path="/v1/embeddings",status="499"')
        gate.release()
        r = c.post("/v1/embeddings", json={"model": "emb", "input": "next"})
        assert r.status_code == 200 and len(r.json()["data"]) == 1
        # the gone request's first sub-batch ran, the other 19 were skipped; then the next request's one input
        assert gate.items == [1, 1]


def test_an_abandoned_image_request_stops_encoding(tmp_path):
    from vision_helpers import data_url, picture, tiny_gemma3

    folder = tiny_gemma3(tmp_path / "gemma3v")
    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.02, block_size=16), models=(str(folder),),
                       keep_alive=None, max_images=8)
    with serve(cfg) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        def chat(images):
            return {"model": "gemma3v", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what?"},
                *({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images)]}]}

        assert c.post("/v1/chat/completions", json=chat([picture(40, 30, seed=99)])).status_code == 200
        family = s.manager.entries["gemma3v"].lm.vision.family
        gate = family.encode = Gate(family.encode)
        six = [picture(40, 30, seed=10 + i) for i in range(6)]
        post_and_leave(s.url, "/v1/chat/completions", chat(six), gate,
                       'path="/v1/chat/completions",status="499"')
        gate.release()
        r = c.post("/v1/chat/completions", json=chat([picture(40, 30, seed=50)] * 3))
        assert r.status_code == 200, r.text
        # the gone request's first batch (2 images) and no more; the next request's image once (three copies)
        assert gate.items == [2, 1]
        family.encode = gate.fn
        _abandoned_between_layers(s.manager.entries["gemma3v"].lm.vision, picture(40, 30, seed=77))


def _abandoned_between_layers(vision, png: bytes) -> None:
    """An encode whose request goes away during its first layer stops before the next one (vision/stop.py)."""
    import io

    from PIL import Image

    from edgeserve.vision.runtime import EncodeAbandoned

    calls = []

    def abandoned() -> bool:  # checked before the batch, then before each tower layer: gone at the second layer
        calls.append(1)
        return len(calls) >= 3

    prepared = vision.family.preprocess(Image.open(io.BytesIO(png)).convert("RGB"))
    with pytest.raises(EncodeAbandoned):
        vision.embeddings([prepared], [b"gone-image"], abandoned)
    assert len(calls) == 3 and b"gone-image" not in vision._cache


def test_a_stopping_embedding_engine_ends_its_batch_at_the_next_sub_batch(tmp_path):
    """What the server's stop (SIGINT / SIGTERM) does to an embedding batch in flight: its next sub-batch does not
    run, and its requests get an error instead of holding the process."""
    import anyio
    import anyio.to_thread

    from edgeserve.engine.runner.embedder import EmbeddingEngine
    from edgeserve.errors import EngineError
    from edgeserve.registry import resolve
    from edgeserve.server.model_manager import load_embedder

    lm = load_embedder(resolve(str(write_tiny_llama(tmp_path / "emb.gguf", pooling_type=1))), ServerConfig())
    engine = EmbeddingEngine(lm, max_batch_tokens=8)
    gate = lm.embed = Gate(lm.embed)
    seqs = [lm.tokenizer.encode(f"input {i}") for i in range(10)]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)

            async def stop_once_started() -> None:
                await anyio.to_thread.run_sync(gate.started.wait)
                engine.shutdown()
                gate.release()

            tg.start_soon(stop_once_started)
            with pytest.raises(EngineError, match="shutting down"):
                await engine.embed(seqs)

    anyio.run(main)
    assert gate.items == [1]
