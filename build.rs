//! Compiles `proto/` with protox (pure Rust, no `protoc` needed) and writes the
//! file descriptor set that server reflection serves. The replicas' own
//! package, `tinybroker.cluster.v1`, is compiled apart: message types only,
//! and kept out of reflection (no client has any use for it).

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/tinybroker/v1/broker.proto", "proto/tinybroker/v1/admin.proto"];
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(protos, ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("tinybroker_descriptor.bin"), fds.encode_to_vec())?;
    // Message types and clients.
    tonic_prost_build::configure()
        .build_server(false)
        .bytes(".tinybroker.v1.PublishRequest.payload")
        .bytes(".tinybroker.v1.Message.payload")
        .compile_fds(fds.clone())?;
    // Servers, using the types above, with our codec (`grpc::codec::ServerCodec`).
    // Subscription streams do not go through it: `grpc::SubscriptionBody`
    // encodes their deliveries itself.
    let server_dir = out_dir.join("server");
    std::fs::create_dir_all(&server_dir)?;
    tonic_prost_build::configure()
        .build_client(false)
        .out_dir(&server_dir)
        .extern_path(".tinybroker.v1", "crate::pb")
        .codec_path("crate::pb::codec::ServerCodec")
        .compile_fds(fds)?;
    // What only replicas exchange (`cluster::wire`); its descriptor set is
    // written for a test, not served.
    let cluster = protox::compile(["proto/tinybroker/cluster/v1/cluster.proto"], ["proto"])?;
    std::fs::write(out_dir.join("cluster_descriptor.bin"), cluster.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .bytes(".tinybroker.cluster.v1.Envelope.payload")
        .compile_fds(cluster)?;
    Ok(())
}
