//! Compiles the vendored Kubernetes protos (device plugin v1beta1, PodResources v1)
//! with protox, a protobuf compiler written in Rust, so building needs no protoc.
//! Both halves of every service are generated: the plugin serves DevicePlugin and
//! calls Registration and PodResources; the test kubelet (tests/cri) does the
//! opposite, over the same generated code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/deviceplugin/v1beta1/api.proto",
        "proto/podresources/v1/api.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    // The protos' comments are Go-flavoured markdown that rustdoc would read as
    // indented code blocks (doctests) and clippy as broken lists: the protos are
    // the documentation.
    let mut messages = prost_build::Config::new();
    messages.disable_comments(["."]);
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Channels are built by hand over unix sockets: no transport helpers.
        .build_transport(false)
        .disable_comments(["."])
        .compile_fds_with_config(descriptors, messages)?;
    Ok(())
}
