//! Generated protobuf types and tonic services for `tinybroker.v1`, and the
//! encoded file descriptor set that server reflection serves; and the types
//! of `tinybroker.cluster.v1`, what only replicas exchange.

pub mod codec;
pub mod metadata;

pub use generated::*;

/// What `build.rs` generates is not ours to lint.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
mod generated {
    tonic::include_proto!("tinybroker.v1");
}

/// The generated servers. Their subscription streams send
/// [`crate::grpc::framing::EncodedMessage`], which is a `Message` on the wire.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
mod servers {
    include!(concat!(env!("OUT_DIR"), "/server/tinybroker.v1.rs"));
}

pub use servers::{admin_server, broker_server};

/// `proto/tinybroker/cluster/v1/cluster.proto`: the envelope and the calls
/// between replicas (`cluster::wire`, `cluster::rpc`). Not the contract,
/// and not in [`FILE_DESCRIPTOR_SET`]. Some generated helpers go unused.
#[allow(dead_code, clippy::all, clippy::pedantic, missing_docs)]
pub(crate) mod cluster {
    include!(concat!(env!("OUT_DIR"), "/tinybroker.cluster.v1.rs"));
}

/// Descriptors of `proto/tinybroker/v1/*.proto` and their imports.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tinybroker_descriptor.bin"));

/// The fully qualified name health checks use for the Broker service.
pub const BROKER_SERVICE_NAME: &str = "tinybroker.v1.Broker";
