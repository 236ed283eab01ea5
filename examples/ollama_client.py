"""Talk to `edgeserve serve` through its Ollama-compatible API with only the standard library.

    edgeserve serve &
    python examples/ollama_client.py "Why is the sky blue?"

Set EDGESERVE_HOST (default http://127.0.0.1:8000).
"""

import json
import os
import sys
import urllib.request

HOST = os.environ.get("EDGESERVE_HOST", "http://127.0.0.1:8000")
prompt = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue?"


def post(path: str, body: dict):
    req = urllib.request.Request(HOST + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req)


print("version:", json.load(urllib.request.urlopen(HOST + "/api/version"))["version"])
models = [m["name"] for m in json.load(urllib.request.urlopen(HOST + "/api/tags"))["models"]]
print("models:", models)
model = models[0]

# streamed chat: one JSON object per line, the last has "done": true and the counters
print("\n[chat] ", end="", flush=True)
with post("/api/chat", {"model": model, "messages": [{"role": "user", "content": prompt}],
                        "options": {"temperature": 0, "num_predict": 64}}) as r:
    for line in r:
        msg = json.loads(line)
        print(msg["message"]["content"], end="", flush=True)
        if msg["done"]:
            print(f"\n[done: {msg['done_reason']}, {msg['prompt_eval_count']} prompt tokens, "
                  f"{msg['eval_count']} generated in {msg['eval_duration'] / 1e9:.2f}s]")

# one reply, not streamed, from /api/generate
with post("/api/generate", {"model": model, "prompt": "Say hello in French.", "stream": False,
                            "options": {"num_predict": 16, "seed": 1}}) as r:
    print("\n[generate]", json.load(r)["response"])

ps = json.load(urllib.request.urlopen(HOST + "/api/ps"))["models"]
print("\n[ps]", [(m["name"], m["status"], m["expires_at"]) for m in ps])
# keep_alive 0 unloads the model now (memory is given back); it loads again on the next request
with post("/api/generate", {"model": model, "keep_alive": 0}) as r:
    print("[unload]", json.load(r)["done_reason"])
print("[ps]", json.load(urllib.request.urlopen(HOST + "/api/ps"))["models"])
