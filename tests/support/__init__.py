"""Test support shared by the test modules: one GGUF writer (gguf_writer.py) that writes tiny checkpoints the way
llama.cpp's convert_hf_to_gguf.py does, checked against it by tests/test_support_gguf_writer.py."""
