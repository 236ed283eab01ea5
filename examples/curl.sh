#!/usr/bin/env bash
# A walk through edgeserve's HTTP API with curl. Start the server first:  edgeserve serve
# Then:  bash examples/curl.sh      (EDGESERVE_HOST overrides http://127.0.0.1:8000;
#                                    EDGESERVE_API_KEY is sent as a bearer token when set)
set -euo pipefail
HOST=${EDGESERVE_HOST:-http://127.0.0.1:8000}
AUTH=()
[ -n "${EDGESERVE_API_KEY:-}" ] && AUTH=(-H "Authorization: Bearer $EDGESERVE_API_KEY")
say() { printf '\n\033[1m# %s\033[0m\n' "$*"; }

say "health (never needs a key): is a model loading?"
curl -s "$HOST/health"; echo

say "models"
curl -s "${AUTH[@]}" "$HOST/v1/models"; echo
MODEL=$(curl -s "${AUTH[@]}" "$HOST/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

say "chat completion (the first request loads the model)"
curl -s "${AUTH[@]}" "$HOST/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "messages": [{"role": "user", "content": "Name three primary colors."}],
  "max_tokens": 32, "temperature": 0}'; echo

say "streamed (SSE: one data: event per delta, then data: [DONE]; -N turns off curl's buffering)"
curl -sN "${AUTH[@]}" "$HOST/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "messages": [{"role": "user", "content": "Count to five."}],
  "max_tokens": 24, "stream": true, "stream_options": {"include_usage": true}}'

say "completion with a stop string and logprobs"
curl -s "${AUTH[@]}" "$HOST/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0, "stop": [" 6"], "logprobs": 2}'; echo

say "an error: a bad field gets a 400 that names it"
curl -s "${AUTH[@]}" "$HOST/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}'; echo

say "Ollama API: streamed NDJSON"
curl -sN "${AUTH[@]}" "$HOST/api/generate" -d '{"model": "'"$MODEL"'", "prompt": "Say hi.", "options": {"num_predict": 8}}'

say "loaded models, then unload with keep_alive 0"
curl -s "${AUTH[@]}" "$HOST/api/ps"; echo
curl -s "${AUTH[@]}" "$HOST/api/generate" -d '{"model": "'"$MODEL"'", "keep_alive": 0}'; echo

say "metrics (Prometheus text), first lines"
curl -s "${AUTH[@]}" "$HOST/metrics" | grep -v '^#' | sed -n '1,12p'
