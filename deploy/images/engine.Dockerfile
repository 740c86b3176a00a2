# The node-local engine: Debian's dockerd with gVisor's runsc registered (its ptrace platform, no network,
# as scripts/register-runsc sets it on a host). It runs privileged beside one replica, which alone uses it.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends docker.io runsc ca-certificates iptables \
    && rm -rf /var/lib/apt/lists/*
COPY engine-daemon.json /etc/docker/daemon.json
ENTRYPOINT ["dockerd", "--host=unix:///run/metaagent/docker.sock", "--bridge=none", "--iptables=false"]
