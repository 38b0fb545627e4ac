//! Compiles `proto/` with protox (pure Rust, no `protoc` needed) and writes the
//! file descriptor set that server reflection serves.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/tinybroker/v1/broker.proto", "proto/tinybroker/v1/admin.proto"];
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(protos, ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("tinybroker_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .bytes(".tinybroker.v1.PublishRequest.payload")
        .bytes(".tinybroker.v1.Message.payload")
        .compile_fds(fds)?;
    Ok(())
}
