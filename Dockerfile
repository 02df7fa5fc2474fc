# The image `flotilla k8s --image` names: the release binary on the PATH, run as the non-root
# user (uid and gid 10001) the manifests' securityContext names.
#
#   docker build -t REGISTRY/flotilla:TAG . && docker push REGISTRY/flotilla:TAG
# (a CPU build: the `cuda` feature needs the CUDA toolkit in both stages).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# What the build reads: the crate, and the data, config and fonts compiled into the binary.
COPY Cargo.toml Cargo.lock config.toml ./
COPY src ./src
COPY benches ./benches
COPY examples ./examples
COPY data ./data
COPY assets ./assets
RUN cargo build --release --locked --bin flotilla

FROM debian:bookworm-slim
# The binary needs only glibc and libgcc, which the base has.
COPY --from=build /src/target/release/flotilla /usr/local/bin/flotilla
# The shipped configs (`--config /opt/flotilla/examples/gpt.toml`); the default job's data is
# in the binary.
COPY config.toml /opt/flotilla/config.toml
COPY examples/*.toml /opt/flotilla/examples/
# The user the pods run as; its home is where they mount the checkpoint volume and work.
RUN groupadd --gid 10001 flotilla \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/flotilla --create-home --shell /usr/sbin/nologin flotilla
USER 10001:10001
WORKDIR /var/lib/flotilla
ENTRYPOINT ["flotilla"]
CMD ["--help"]
