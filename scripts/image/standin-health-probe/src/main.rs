//! Stand-in for grpc-ecosystem/grpc-health-probe, plaintext only: what the
//! chart's exec probes and `helm test` script use of it.
//!
//! Flags (Go style: one or two dashes, `-flag=value` or `-flag value`):
//! `-addr`, `-service`, `-connect-timeout`, `-rpc-timeout` (`3s`, `500ms`).
//! Exit codes as upstream: 0 SERVING, 1 bad arguments, 2 connection failure,
//! 3 RPC failure, 4 not SERVING.
use std::process::exit;
use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn duration(flag: &str, value: &str) -> Duration {
    let parsed = if let Some(ms) = value.strip_suffix("ms") {
        ms.parse().ok().map(Duration::from_millis)
    } else if let Some(s) = value.strip_suffix('s') {
        s.parse().ok().map(Duration::from_secs_f64)
    } else {
        None
    };
    parsed.unwrap_or_else(|| {
        eprintln!("invalid value {value:?} for -{flag}");
        exit(1)
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut addr = String::new();
    let mut service = String::new();
    let mut connect_timeout = Duration::from_secs(1);
    let mut rpc_timeout = Duration::from_secs(1);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let arg = arg.trim_start_matches('-').to_owned();
        let (flag, value) = match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), v.to_owned()),
            None => (arg.clone(), args.next().unwrap_or_default()),
        };
        match flag.as_str() {
            "addr" => addr = value,
            "service" => service = value,
            "connect-timeout" => connect_timeout = duration(&flag, &value),
            "rpc-timeout" => rpc_timeout = duration(&flag, &value),
            _ => {
                eprintln!("flag -{flag} not supported by this stand-in");
                exit(1)
            }
        }
    }
    if addr.is_empty() {
        eprintln!("-addr not specified");
        exit(1)
    }
    let endpoint = match tonic::transport::Endpoint::from_shared(format!("http://{addr}")) {
        Ok(e) => e.connect_timeout(connect_timeout).timeout(rpc_timeout),
        Err(e) => {
            eprintln!("invalid -addr {addr:?}: {e}");
            exit(1)
        }
    };
    let channel = match tokio::time::timeout(connect_timeout, endpoint.connect()).await {
        Ok(Ok(channel)) => channel,
        Ok(Err(e)) => {
            eprintln!("error: failed to connect service at {addr:?}: {e}");
            exit(2)
        }
        Err(_) => {
            eprintln!("timeout: failed to connect service {addr:?} within {connect_timeout:?}");
            exit(2)
        }
    };
    let request = HealthCheckRequest { service };
    match tokio::time::timeout(rpc_timeout, HealthClient::new(channel).check(request)).await {
        Ok(Ok(response)) => {
            let status = response.into_inner().status;
            // grpc.health.v1.HealthCheckResponse.ServingStatus: 1 = SERVING.
            if status == 1 {
                println!("status: SERVING");
                exit(0)
            }
            println!("service unhealthy (responded with status {status})");
            exit(4)
        }
        Ok(Err(e)) => {
            eprintln!("error: health rpc failed: {e}");
            exit(3)
        }
        Err(_) => {
            eprintln!("timeout: health rpc did not complete within {rpc_timeout:?}");
            exit(3)
        }
    }
}
