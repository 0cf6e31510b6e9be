# ratewall: multi-stage build, small non-root runtime image.
#
#   docker build -t ratewall .
#   docker run --rm -p 8080:8080 -v "$PWD/config:/etc/ratewall:ro" ratewall
#
# Mount the whole config folder: limits.toml names its keys file (keys.toml) relative to
# itself, and SIGHUP (docker kill -s HUP) re-reads both.
# The mounted config must listen on 0.0.0.0 (not 127.0.0.1) to be reachable from outside
# the container, e.g. listen = "0.0.0.0:8080".

FROM rust:1-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so editing src/ does not rebuild them.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src
COPY src ./src
COPY lua ./lua
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin ratewall

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin ratewall
COPY --from=build /src/target/release/ratewall /usr/local/bin/ratewall
COPY config/limits.toml config/keys.toml /etc/ratewall/
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/ratewall", "--config", "/etc/ratewall/limits.toml"]
