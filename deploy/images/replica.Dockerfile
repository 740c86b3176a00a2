# The replica's image: the service, its Python dependencies, and what `metaagent sandbox build` needs
# (debootstrap, npm). It reaches its node's engine through DOCKER_HOST. It serves as an unprivileged user;
# only the sandbox build (an init container in deploy/kubernetes) runs it as root.
FROM python:3.11-slim-bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends debootstrap npm ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/metaagent --create-home metaagent
WORKDIR /opt/metaagent
COPY pyproject.toml uv.lock README.md ./
COPY src ./src
RUN pip install --no-cache-dir .
ENV XDG_STATE_HOME=/var/lib/metaagent/state METAAGENT_SANDBOX_CACHE_DIR=/var/cache/metaagent
USER 10001
EXPOSE 3102
ENTRYPOINT ["metaagent"]
CMD ["serve", "--host", "0.0.0.0", "--port", "3102"]
