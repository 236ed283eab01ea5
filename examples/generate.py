"""Generate a reply with the default model from Python (greedy), streaming it to the terminal.

    python examples/generate.py "Why is the sky blue?"
"""

import sys

from edgeserve.engine.single import generate
from edgeserve.models.load import load_model
from edgeserve.registry import DEFAULT_MODEL, resolve
from edgeserve.sampling_params import SamplingParams

prompt = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue?"
lm = load_model(resolve(DEFAULT_MODEL))
ids = lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)
for delta in generate(lm, ids, SamplingParams(temperature=0.0, max_tokens=128)):
    print(delta.text, end="", flush=True)
print()
