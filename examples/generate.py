"""Use edgeserve from Python: a batch of prompts, a chat, and a streamed reply (default model, greedy).

    python examples/generate.py "Why is the sky blue?"
"""

import sys

from edgeserve import LLM, SamplingParams

question = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue?"
llm = LLM("smollm2-135m")
greedy = SamplingParams(temperature=0, max_tokens=64)

# Several prompts batched through the engine together; results come back in prompt order.
for result in llm.generate(["The capital of France is", "def fibonacci(n):"], greedy):
    print(repr(result.prompt), "->", repr(result.text))

# A chat through the model's own chat template.
print(llm.chat([{"role": "user", "content": question}], greedy)[0].text)

# A streamed reply, delta by delta.
ids = llm.tokenizer.encode(llm.lm.chat_template.render([{"role": "user", "content": question}]), add_special_tokens=False)
for delta in llm.stream(ids, SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=128)):
    print(delta.text, end="", flush=True)
print()
