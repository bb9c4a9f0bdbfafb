//! Compiles the vendored CRI proto (proto/api.proto) into a tonic client with
//! protox, a protobuf compiler written in Rust, so building needs no protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    // The proto's comments are Go-flavoured markdown that rustdoc would read as
    // indented code blocks (doctests) and clippy as broken lists: the proto itself
    // is the documentation. Messages take this from prost's config, the service
    // from tonic's builder.
    let mut messages = prost_build::Config::new();
    messages.disable_comments(["."]);
    tonic_prost_build::configure()
        // kubelet's half only: the tests call containerd, they serve nothing.
        .build_server(false)
        .build_transport(false)
        .disable_comments(["."])
        .compile_fds_with_config(descriptors, messages)?;
    Ok(())
}
