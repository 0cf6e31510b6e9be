# ratewall: multi-stage build, small non-root runtime image.
#
#   docker build -t ratewall .
#   # The secret identity tags are keyed by, kept with the config (the gateway cannot write
#   # to a read-only mount; docs/configuration.md, tag_secret).
#   [ -f config/.ratewall-tag-secret ] || openssl rand -hex 32 > config/.ratewall-tag-secret
#   docker run --rm -p 8080:8080 -p 8443:8443 -p 127.0.0.1:9090:9090 \
#     --user "$(id -u):$(id -g)" \
#     -e RATEWALL_LISTEN=0.0.0.0:8080 -e RATEWALL_ADMIN_LISTEN=0.0.0.0:9090 \
#     -e RATEWALL_UPSTREAM=http://host.docker.internal:3000 \
#     --add-host=host.docker.internal:host-gateway \
#     -v "$PWD/config:/etc/ratewall:ro" ratewall
#
# With [server.tls] uncommented, add -e RATEWALL_TLS_LISTEN=0.0.0.0:8443. `--user` runs the
# gateway as the owner of the mounted files: a private key is mode 0600 (openssl writes
# it so), readable by its owner alone, and the image's own uid 10001 could not read it.
# The config is /etc/ratewall/limits.toml (the shipped one is copied in; mount your config
# folder over it, with the keys file it names). SIGHUP (docker kill -s HUP) re-reads both.
# Inside a container 127.0.0.1 is the container itself: RATEWALL_LISTEN and
# RATEWALL_ADMIN_LISTEN make it listen where a published port reaches it, and
# RATEWALL_UPSTREAM points it at a backend it can reach (README.md, "Docker"). They
# override the file and hold across reloads (docs/configuration.md, "Command line").
# .dockerignore keeps target/ and the rest of the repository out of the build context.

FROM rust:1-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so editing src/ does not rebuild them. The workspace's other members
# (the demo backend, demo/, and the benchmark's load tools, bench/load/) must be there for
# Cargo to read the workspace; only their manifests are needed, neither is built.
COPY Cargo.toml Cargo.lock ./
COPY demo/Cargo.toml ./demo/
COPY bench/load/Cargo.toml ./bench/load/
RUN mkdir src demo/src bench/load/src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && echo 'fn main() {}' > demo/src/main.rs && touch bench/load/src/lib.rs \
    && cargo build --release --locked --package ratewall \
    && rm -rf src
COPY src ./src
COPY lua ./lua
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --package ratewall --bin ratewall

FROM debian:bookworm-slim
# The system's roots, which an https:// upstream is verified against (without `ca`).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin ratewall
COPY --from=build /src/target/release/ratewall /usr/local/bin/ratewall
COPY config/limits.toml config/keys.toml /etc/ratewall/
USER 10001:10001
# 8443: the TLS listener, where [server.tls] is configured; 8081: the decision service,
# where [decide] is configured (its listen must then be 0.0.0.0:8081, not loopback);
# 3128: the egress gateway, where [egress] is configured (listen = "0.0.0.0:3128").
EXPOSE 8080 8443 9090 8081 3128
ENTRYPOINT ["/usr/local/bin/ratewall", "--config", "/etc/ratewall/limits.toml"]
