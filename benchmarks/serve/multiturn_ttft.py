"""Second-turn TTFT of a two-turn conversation (first turn cached), edgeserve vs llama-server, same GGUF.
Text prompts on /v1/completions (no chat template), greedy. Turn 1: ~1,000-token user message, 32 tokens out
(not timed). Turn 2: turn 1's prompt + its reply + a new ~60-token user message, streamed, 4 out; TTFT timed.
Both servers up at once, one request at a time, order alternating per round.
EDGESERVE_BASELINE_PATH=DIR adds a third peer, "edgeserve-baseline": edgeserve run with PYTHONPATH=DIR (a package
tree of another commit: DIR/edgeserve with kernels/, loaders/, offload/ inside it), for before/after in one run."""
import argparse, json, os, random, subprocess, sys, time, socket
import httpx

_ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_ap.add_argument("model", help="the GGUF both servers load")
_ap.add_argument("llama_server", help="path of llama-server")
_ap.add_argument("rounds", type=int)
_ap.add_argument("json_out", nargs="?", help="also write the per-round results here")
ARGS = _ap.parse_args()
MODEL, LLAMA, ROUNDS = ARGS.model, ARGS.llama_server, ARGS.rounds
WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be has had "
         "model layer state token cache memory server prompt turn reply value weight matrix vector head time").split()

EXTRA = {"edgeserve": {}, "edgeserve-baseline": {}, "llama.cpp": {"cache_prompt": True, "repeat_penalty": 1.0}}
BASELINE = os.environ.get("EDGESERVE_BASELINE_PATH")
os.makedirs("/tmp/q35mt", exist_ok=True)

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def wait(url, path):
    for _ in range(600):
        try:
            if httpx.get(url + path, timeout=2).status_code == 200: return
        except Exception: pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy")

lp, ep = port(), port()
llama = subprocess.Popen([LLAMA, "-m", MODEL, "--host", "127.0.0.1", "--port", str(lp), "--parallel", "8", "-c", "34816",
                          "--cont-batching", "-t", "2", "-tb", "2", "--no-webui"],
                         stdout=open("/tmp/q35mt/llama.log", "w"), stderr=subprocess.STDOUT)
ours = subprocess.Popen([sys.executable, "-m", "edgeserve", "serve", "--model", MODEL, "--port", str(ep), "--max-seqs", "8",
                         "--log-level", "warning", "--keep-alive", "-1"], env=dict(os.environ, OMP_NUM_THREADS="2"),
                        stdout=open("/tmp/q35mt/edgeserve.log", "w"), stderr=subprocess.STDOUT)
peers = {"llama.cpp": f"http://127.0.0.1:{lp}", "edgeserve": f"http://127.0.0.1:{ep}"}
if BASELINE:
    bp = port()
    base = subprocess.Popen([sys.executable, "-m", "edgeserve", "serve", "--model", MODEL, "--port", str(bp),
                             "--max-seqs", "8", "--log-level", "warning", "--keep-alive", "-1"],
                            env=dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=BASELINE),
                            stdout=open("/tmp/q35mt/edgeserve-baseline.log", "w"), stderr=subprocess.STDOUT)
    peers["edgeserve-baseline"] = f"http://127.0.0.1:{bp}"
try:
    for u in peers.values(): wait(u, "/health")
    models = {k: httpx.get(u + "/v1/models", timeout=30).json()["data"][0]["id"] for k, u in peers.items()}
    # warm-up (edgeserve loads the model on its first request)
    for k, u in peers.items():
        httpx.post(u + "/v1/completions", json={"model": models[k], "prompt": "hi", "max_tokens": 2}, timeout=600)
    res = {k: [] for k in peers}
    for r in range(ROUNDS):
        rng = random.Random(1000 + r)
        p1 = "User: " + " ".join(rng.choice(WORDS) for _ in range(990)) + "\nAssistant:"
        new = "\nUser: " + " ".join(rng.choice(WORDS) for _ in range(55)) + "\nAssistant:"
        order = list(peers) if r % 2 == 0 else list(reversed(peers))
        for k in order:
            u = peers[k]
            t1 = httpx.post(u + "/v1/completions", json={"model": models[k], "prompt": p1, "max_tokens": 32,
                            "temperature": 0, "ignore_eos": True, **EXTRA[k]}, timeout=600).json()
            p2 = p1 + t1["choices"][0]["text"] + new
            body = {"model": models[k], "prompt": p2, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True, **EXTRA[k]}
            t0 = time.perf_counter(); ttft = None
            with httpx.stream("POST", u + "/v1/completions", json=body, timeout=600) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and ttft is None and '"choices"' in line:
                        ttft = time.perf_counter() - t0
            res[k].append({"ttft_ms": ttft * 1000, "turn1_prompt_tokens": t1["usage"]["prompt_tokens"]})
            print(k, r + 1, res[k][-1], file=sys.stderr, flush=True)
    if ARGS.json_out:
        json.dump(res, open(ARGS.json_out, "w"), indent=1)
    import statistics
    med = {k: statistics.median(x["ttft_ms"] for x in v) for k, v in res.items()}
    ratios = {k: med[k] / med["llama.cpp"] for k in med if k != "llama.cpp"}
    print(json.dumps({"per_round": res, "median_ms": med, "ratio": ratios["edgeserve"], "ratios": ratios}, indent=1))
finally:
    servers = [llama, ours] + ([base] if BASELINE else [])
    for s in servers: s.terminate()
    for s in servers: s.wait()
