"""Talk to `edgeserve serve` with the official openai SDK: sync, streaming, and async.

    edgeserve serve &                      # in another terminal; the model loads on the first request
    python examples/openai_client.py "Why is the sky blue?"

Set EDGESERVE_URL (default http://127.0.0.1:8000/v1) and EDGESERVE_API_KEY if the server needs a key.
Needs the `openai` package, which edgeserve itself does not install: `python -m pip install openai` (or
`python -m pip install -e ".[examples]"`); examples/ollama_client.py needs only the standard library.
"""

import asyncio
import os
import sys

try:
    import openai
except ImportError:
    sys.exit("this example needs the openai package: python -m pip install openai "
             "(examples/ollama_client.py needs only the standard library)")

URL = os.environ.get("EDGESERVE_URL", "http://127.0.0.1:8000/v1")
KEY = os.environ.get("EDGESERVE_API_KEY", "none")  # the SDK insists on a key; the server ignores it unless set
prompt = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue?"

client = openai.OpenAI(base_url=URL, api_key=KEY)
model = client.models.list().data[0].id
print(f"models: {[m.id for m in client.models.list().data]}")

# 1. one reply, not streamed
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64,
                                   temperature=0)
print(f"\n[sync] {r.choices[0].message.content}")
print(f"[usage] {r.usage.prompt_tokens} prompt ({r.usage.prompt_tokens_details.cached_tokens} cached) + "
      f"{r.usage.completion_tokens} completion tokens, finish_reason={r.choices[0].finish_reason}")

# 2. streamed, token by token
print("\n[stream] ", end="", flush=True)
for chunk in client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": prompt}],
                                            max_tokens=64, temperature=0.7, seed=42, stream=True):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()


# 3. async: several requests at once (the server batches them)
async def several() -> None:
    ac = openai.AsyncOpenAI(base_url=URL, api_key=KEY)
    questions = ["Name a color.", "Name a fruit.", "Name a planet."]
    replies = await asyncio.gather(*[
        ac.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=16,
                                   temperature=0) for q in questions])
    for q, r in zip(questions, replies):
        print(f"[async] {q} -> {r.choices[0].message.content!r}")
    await ac.close()

asyncio.run(several())
