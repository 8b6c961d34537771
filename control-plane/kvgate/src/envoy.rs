//! `kvgate envoy-config`: a plain-Envoy bootstrap with the kvgate filter.

use anyhow::{Context, Result};

/// `kvgate envoy-config`: the bootstrap's inputs.
#[derive(clap::Args)]
pub(crate) struct EnvoyConfigArgs {
    /// Where clients connect.
    #[arg(long, default_value = "0.0.0.0:10000")]
    listen: std::net::SocketAddr,
    /// Envoy's admin port (on 127.0.0.1 only).
    #[arg(long, default_value_t = 9901)]
    admin_port: u16,
    /// A vLLM worker `ip:port` (repeat for each).
    #[arg(long = "worker", required = true)]
    workers: Vec<std::net::SocketAddr>,
    /// A control-plane replica `ip:port` (repeat for each).
    #[arg(long = "control-plane", default_value = "127.0.0.1:50051")]
    control_plane: Vec<std::net::SocketAddr>,
    /// The built filter (`kvgate_filter.wasm`).
    #[arg(long)]
    wasm: std::path::PathBuf,
    /// The filter's JSON configuration (see filter/README.md), one line.
    #[arg(long, default_value = "{}")]
    filter_config: String,
    /// Mutual TLS to the control plane: CA of its certificate (with
    /// --tls-cert, --tls-key, --tls-sni).
    #[arg(long, requires_all = ["tls_cert", "tls_key", "tls_sni"])]
    tls_ca: Option<std::path::PathBuf>,
    /// Envoy's client certificate chain.
    #[arg(long, requires = "tls_ca")]
    tls_cert: Option<std::path::PathBuf>,
    /// Its private key.
    #[arg(long, requires = "tls_ca")]
    tls_key: Option<std::path::PathBuf>,
    /// The name in the control plane's certificate.
    #[arg(long, requires = "tls_ca")]
    tls_sni: Option<String>,
    /// Write here instead of standard output.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// `kvgate envoy-config`.
pub(crate) fn run(a: EnvoyConfigArgs) -> Result<()> {
    let filter: serde_json::Value = serde_json::from_str(&a.filter_config).context("--filter-config: not JSON")?;
    let tls = match (a.tls_ca, a.tls_cert, a.tls_key, a.tls_sni) {
        (Some(ca), Some(cert), Some(key), Some(sni)) => Some(kvgate_envoy_config::ControlPlaneTls {
            ca_file: ca.display().to_string(),
            cert_file: cert.display().to_string(),
            key_file: key.display().to_string(),
            sni,
        }),
        _ => None,
    };
    let boot = kvgate_envoy_config::KvgateBootstrap {
        listen: a.listen,
        admin_port: a.admin_port,
        workers: a.workers,
        control_plane: a.control_plane,
        wasm_path: a.wasm.display().to_string(),
        // One line, re-serialized: the template quotes it in single quotes.
        filter_config: filter.to_string().replace('\'', "\\u0027"),
        tls,
    };
    let yaml = boot.render()?;
    match a.out {
        Some(path) => std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?,
        None => print!("{yaml}"),
    }
    Ok(())
}
