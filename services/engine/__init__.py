"""Tandem's reference inference engine: SGLang's HTTP API over a Hugging Face model, on CPU or CUDA."""
