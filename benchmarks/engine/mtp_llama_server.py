"""llama-server's MTP drafting cost on a random Qwen3.5 GGUF with an MTP block (issue 50): two llama-servers up at once,
plain and `--spec-type draft-mtp --spec-draft-n-max 2`, one thread each; CPU seconds of each server process per
32-token greedy request (/proc/PID/stat utime + stime: steadier than wall time on a shared machine), requests
alternating, plus the server's own timings. Random weights: its drafts are never accepted, so the ratio is the cost
of a drafting + verifying step against a plain one; compare benchmarks/engine/mtp_oracle.py --accept 0.0.

    python benchmarks/engine/mtp_llama_server.py FILE.gguf [ROUNDS]   (the GGUF: mtp_oracle.py --out writes one)
"""
import json, os, subprocess, sys, time, urllib.request, statistics
BIN = os.path.expanduser("~/.cache/edgeserve/reference/llama-server-build/bin/llama-server")
GGUF = sys.argv[1]
TICK = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    """CPU seconds the process has used."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK
def start(port, extra):
    """A llama-server on `port` with flags `extra`, once /health answers."""
    p = subprocess.Popen([BIN, "-m", GGUF, "--port", str(port), "-t", "1", "-tb", "1", "-c", "512", "-np", "1",
                          "--no-warmup", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2); return p
        except Exception:
            time.sleep(1)
    raise SystemExit(f"server {port} did not start")
def ask(port):
    """One 32-token greedy completion of a fixed 8-token prompt."""
    body = json.dumps({"prompt": [1500, 2300, 4100, 9000, 12000, 700, 3300, 15000], "n_predict": 32, "temperature": 0,
                       "ignore_eos": True, "cache_prompt": False}).encode()
    r = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                                      {"Content-Type": "application/json"}), timeout=900)
    return json.loads(r.read())
sides = {"plain": start(18711, []), "draft-mtp n_max=2": start(18712, ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"])}
ports = {"plain": 18711, "draft-mtp n_max=2": 18712}
res = {s: [] for s in sides}
try:
    for s in sides: ask(ports[s])  # warm
    for _ in range(int(sys.argv[2])):
        for s, p in sides.items():
            c0 = cpu(p.pid); out = ask(ports[s]); c1 = cpu(p.pid)
            t = out.get("timings", {})
            res[s].append(c1 - c0)
            print(json.dumps({"side": s, "cpu_s": round(c1 - c0, 3), "n": t.get("predicted_n"),
                              "predicted_per_token_ms": t.get("predicted_per_token_ms"),
                              "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}), flush=True)
finally:
    for p in sides.values(): p.terminate()
base = statistics.median(res["plain"])
for s, r in res.items():
    print(f"{s}: median CPU s per 32 tokens {statistics.median(r):.3f}, tokens per CPU second ratio {base / statistics.median(r):.2f}")
