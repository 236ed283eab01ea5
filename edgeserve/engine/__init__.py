"""The inference engine: sampling, generation loop, and (soon) paged KV and scheduling."""
