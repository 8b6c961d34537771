//! # kvgate-envoy-config
//!
//! The Envoy bootstraps in `envoy/` are templates with `${NAME}`
//! placeholders. This crate embeds them and fills them in, for users
//! (`kvgate envoy-config` prints a plain-Envoy bootstrap with the kvgate
//! filter) and for the tests and benchmarks, so that both run exactly the
//! same configuration.
//!
//! | item | what |
//! |---|---|
//! | [`KvgateBootstrap`] | `envoy/kvgate.yaml`: listener with the filter, worker cluster (override host, retries, outlier detection), control-plane cluster (optionally mutual TLS) |
//! | [`render_local`] | `envoy/local.yaml`: plain Envoy, least request, no filter |
//! | [`render_picker`] | `envoy/endpoint-picker.yaml`: the ext_proc endpoint picker |
//! | [`render_template`] | the placeholder filler itself |

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;

/// `envoy/kvgate.yaml`.
pub const KVGATE_TEMPLATE: &str = include_str!("../../kvgate.yaml");
/// `envoy/control-plane-tls.yaml`: the control-plane cluster's mutual TLS.
pub const CONTROL_PLANE_TLS_TEMPLATE: &str = include_str!("../../control-plane-tls.yaml");
/// `envoy/local.yaml`.
pub const LOCAL_TEMPLATE: &str = include_str!("../../local.yaml");
/// `envoy/endpoint-picker.yaml`.
pub const PICKER_TEMPLATE: &str = include_str!("../../endpoint-picker.yaml");

/// Why a bootstrap could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// A placeholder has no value.
    #[error("no value for ${{{0}}}")]
    Missing(String),
    /// A `${` without its `}`.
    #[error("unclosed placeholder")]
    Unclosed,
    /// A value that cannot be put in the template as it is.
    #[error("{field}: {reason}")]
    Invalid {
        /// Which input.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
}

/// Fills `${NAME}` placeholders; every placeholder must have a value.
pub fn render_template(template: &str, vars: &BTreeMap<&str, String>) -> Result<String, RenderError> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        out.push_str(rest.get(..start).unwrap_or_default());
        let after = rest.get(start + 2..).unwrap_or_default();
        let end = after.find('}').ok_or(RenderError::Unclosed)?;
        let name = after.get(..end).unwrap_or_default();
        let value = vars.get(name).ok_or_else(|| RenderError::Missing(name.to_owned()))?;
        out.push_str(value);
        rest = after.get(end + 1..).unwrap_or_default();
    }
    out.push_str(rest);
    Ok(out)
}

/// Static endpoints as the templates' `lb_endpoints` items.
pub fn endpoints_yaml(addrs: &[SocketAddr]) -> String {
    let mut out = String::new();
    for a in addrs {
        let _ = writeln!(
            out,
            "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
            a.ip(),
            a.port()
        );
    }
    out.trim_end().to_owned()
}

/// The client side of mutual TLS to the control plane: PEM files Envoy reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlaneTls {
    /// CA of the control plane's server certificate.
    pub ca_file: String,
    /// Envoy's client certificate chain.
    pub cert_file: String,
    /// Its private key.
    pub key_file: String,
    /// The name checked in the server certificate (sent as SNI).
    pub sni: String,
}

/// A plain-Envoy bootstrap with the kvgate filter (`envoy/kvgate.yaml`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvgateBootstrap {
    /// Where clients connect (port 0: Envoy picks, see its admin `/listeners`).
    pub listen: SocketAddr,
    /// Envoy's admin port, on 127.0.0.1 (0: Envoy picks).
    pub admin_port: u16,
    /// The vLLM workers (`ip:port`).
    pub workers: Vec<SocketAddr>,
    /// The control-plane replicas (`ip:port`).
    pub control_plane: Vec<SocketAddr>,
    /// The built filter (`kvgate_filter.wasm`).
    pub wasm_path: String,
    /// The filter's JSON configuration (`filter/core/src/config.rs`), one line.
    pub filter_config: String,
    /// Mutual TLS to the control plane.
    pub tls: Option<ControlPlaneTls>,
}

impl KvgateBootstrap {
    /// The bootstrap YAML.
    pub fn render(&self) -> Result<String, RenderError> {
        if self.filter_config.contains(['\'', '\n']) {
            return Err(RenderError::Invalid {
                field: "filter_config",
                reason: "must be one line without single quotes",
            });
        }
        if self.workers.is_empty() {
            return Err(RenderError::Invalid { field: "workers", reason: "at least one worker" });
        }
        if self.control_plane.is_empty() {
            return Err(RenderError::Invalid { field: "control_plane", reason: "at least one control-plane address" });
        }
        let transport_socket = match &self.tls {
            None => String::new(),
            Some(t) => {
                let vars = BTreeMap::from([
                    ("CA_FILE", t.ca_file.clone()),
                    ("CERT_FILE", t.cert_file.clone()),
                    ("KEY_FILE", t.key_file.clone()),
                    ("SNI", t.sni.clone()),
                ]);
                render_template(CONTROL_PLANE_TLS_TEMPLATE, &vars)?.trim_end().to_owned()
            }
        };
        let vars = BTreeMap::from([
            ("LISTEN_ADDRESS", self.listen.ip().to_string()),
            ("LISTEN_PORT", self.listen.port().to_string()),
            ("ADMIN_PORT", self.admin_port.to_string()),
            ("WORKER_ENDPOINTS", endpoints_yaml(&self.workers)),
            ("CONTROL_PLANE_ENDPOINTS", endpoints_yaml(&self.control_plane)),
            ("WASM_PATH", self.wasm_path.clone()),
            ("FILTER_CONFIG", self.filter_config.clone()),
            ("CONTROL_PLANE_TRANSPORT_SOCKET", transport_socket),
        ]);
        render_template(KVGATE_TEMPLATE, &vars)
    }
}

/// `envoy/local.yaml` (no filter) on 127.0.0.1.
pub fn render_local(listen_port: u16, admin_port: u16, workers: &[SocketAddr]) -> Result<String, RenderError> {
    let vars = BTreeMap::from([
        ("LISTEN_PORT", listen_port.to_string()),
        ("ADMIN_PORT", admin_port.to_string()),
        ("WORKER_ENDPOINTS", endpoints_yaml(workers)),
    ]);
    render_template(LOCAL_TEMPLATE, &vars)
}

/// `envoy/endpoint-picker.yaml` on 127.0.0.1, with these ext_proc body
/// modes (`FULL_DUPLEX_STREAMED`, `BUFFERED`, `STREAMED`, `NONE`).
pub fn render_picker(
    listen_port: u16,
    admin_port: u16,
    workers: &[SocketAddr],
    picker: SocketAddr,
    request_body_mode: &str,
    response_body_mode: &str,
) -> Result<String, RenderError> {
    let vars = BTreeMap::from([
        ("LISTEN_PORT", listen_port.to_string()),
        ("ADMIN_PORT", admin_port.to_string()),
        ("WORKER_ENDPOINTS", endpoints_yaml(workers)),
        ("PICKER_ENDPOINTS", endpoints_yaml(&[picker])),
        ("REQUEST_BODY_MODE", request_body_mode.to_owned()),
        ("RESPONSE_BODY_MODE", response_body_mode.to_owned()),
    ]);
    render_template(PICKER_TEMPLATE, &vars)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boot() -> KvgateBootstrap {
        KvgateBootstrap {
            listen: "0.0.0.0:10000".parse().unwrap(),
            admin_port: 9901,
            workers: vec!["10.0.0.5:8000".parse().unwrap(), "10.0.0.6:8000".parse().unwrap()],
            control_plane: vec!["127.0.0.1:50051".parse().unwrap()],
            wasm_path: "/etc/kvgate/kvgate_filter.wasm".into(),
            filter_config: r#"{"failure_mode":"open"}"#.into(),
            tls: None,
        }
    }

    #[test]
    fn every_placeholder_is_filled() {
        let y = boot().render().unwrap();
        assert!(!y.contains("${"), "{y}");
        assert!(y.contains("address: 0.0.0.0, port_value: 10000"));
        assert!(y.contains("address: 10.0.0.6, port_value: 8000"));
        assert!(y.contains(r#"value: '{"failure_mode":"open"}'"#));
        let tls = KvgateBootstrap {
            tls: Some(ControlPlaneTls {
                ca_file: "/ca.crt".into(),
                cert_file: "/tls.crt".into(),
                key_file: "/tls.key".into(),
                sni: "kvgate".into(),
            }),
            ..boot()
        };
        assert!(tls.render().unwrap().contains("/ca.crt"));
    }

    #[test]
    fn bad_inputs_are_named() {
        let e = KvgateBootstrap { filter_config: "{'a':1}".into(), ..boot() }.render().unwrap_err();
        assert!(e.to_string().starts_with("filter_config:"), "{e}");
        let e = KvgateBootstrap { workers: vec![], ..boot() }.render().unwrap_err();
        assert!(e.to_string().starts_with("workers:"), "{e}");
        assert_eq!(render_template("${A", &BTreeMap::new()), Err(RenderError::Unclosed));
        assert_eq!(render_template("${A}", &BTreeMap::new()), Err(RenderError::Missing("A".into())));
    }
}
