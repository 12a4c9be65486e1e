# vllm-ddtree: the official vLLM 0.34.0 image with our patched wheel on top.
# Build with `make image` (it passes the build args from upstream.lock and patches/series).
FROM vllm/vllm-openai:v0.34.0

ARG DDTREE_VERSION=0.34.0+ddtree.1
ARG UPSTREAM_COMMIT=62d4bc3c7
ARG SERIES_SHA256=unknown

LABEL org.opencontainers.image.title="vllm-ddtree" \
      org.opencontainers.image.description="vLLM 0.34.0 with DDTree tree speculative decoding" \
      org.opencontainers.image.version="${DDTREE_VERSION}" \
      org.opencontainers.image.base.name="docker.io/vllm/vllm-openai:v0.34.0" \
      io.github.vllm-ddtree.upstream-commit="${UPSTREAM_COMMIT}" \
      io.github.vllm-ddtree.series-sha256="${SERIES_SHA256}"

# Only our wheel enters the build context (see .dockerignore). Same Python files and
# compiled extensions as upstream except the patched ones: no dependency changes.
COPY dist/vllm-${DDTREE_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl /tmp/ddtree/
RUN python3 -m pip install --no-cache-dir --no-deps --force-reinstall /tmp/ddtree/vllm-*.whl \
    && rm -rf /tmp/ddtree

# The upstream entrypoint.
ENTRYPOINT ["vllm", "serve"]
