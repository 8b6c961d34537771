//! The network side: gRPC (Pick, Report, health), NATS (events, heartbeats,
//! replica sync, snapshots), admin HTTP, periodic upkeep, graceful shutdown.
//!
//! ```text
//! run ─┬─ tonic server (Router, ext_proc, grpc.health.v1) ── App::pick / App::report
//!      ├─ NATS task: one subscription on "<prefix>.>" ── App::on_nats ──▶ snapshot tasks
//!      ├─ replica-sync publisher (batches per model)
//!      ├─ admin HTTP (axum): /metrics /healthz /readyz /admin/*
//!      └─ ticker (250 ms): App::tick (dead workers, expired requests)
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::{App, Config};
use kvgate_epp::ext_proc::external_processor_server::ExternalProcessorServer;

use crate::grpc::{GrpcMetrics, Service};
use crate::router_server::RouterServer;

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Startup failed (models).
    #[error(transparent)]
    Start(#[from] kvgate_core::StartError),
    /// A listener could not bind.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(String),
    /// The TLS files could not be read or used.
    #[error("TLS: {0}")]
    Tls(String),
}

/// Addresses a running server listens on (useful with port 0).
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// gRPC.
    pub grpc: SocketAddr,
    /// Admin HTTP.
    pub admin: Option<SocketAddr>,
}

/// Runs the control plane until `shutdown` resolves. `on_bound` is called
/// once the listeners are bound.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(Bound, Arc<App>) + Send,
) -> Result<(), ServeError> {
    // Certificates are read once, before anything binds: a bad file stops
    // the start with its name. Rotation is a (rolling) restart.
    let mut builder = tonic::transport::Server::builder();
    if let Some(files) = &config.tls {
        builder = builder.tls_config(server_tls(files)?).map_err(|e| ServeError::Tls(format!("{e:?}")))?;
    }
    let (app, inflight_rx) = if config.nats_url.is_some() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (App::with_sink(config, Box::new(crate::nats::Outbox(tx)))?, Some(rx))
    } else {
        (App::new(config)?, None)
    };
    let cfg = &app.config;
    let grpc_listener = bind(cfg.listen_grpc).await?;
    let grpc_addr = grpc_listener.local_addr().map_err(|source| ServeError::Bind { addr: cfg.listen_grpc, source })?;
    let admin_listener = match cfg.listen_admin {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    let admin_addr = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = background(&app, inflight_rx, admin_listener, &stop_rx);
    on_bound(Bound { grpc: grpc_addr, admin: admin_addr }, app.clone());
    tracing::info!(grpc = %grpc_addr, admin = ?admin_addr, replica = %app.config.replica_id, "control plane listening");
    let result = serve_grpc(builder, &app, grpc_listener, shutdown).await;
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    result
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })
}

/// The tasks beside the gRPC server: NATS, upkeep, admin HTTP.
fn background(
    app: &Arc<App>,
    inflight_rx: Option<crate::nats::Inbox>,
    admin: Option<tokio::net::TcpListener>,
    stop_rx: &tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinSet<()> {
    let mut tasks = tokio::task::JoinSet::new();
    if let (Some(url), Some(rx)) = (app.config.nats_url.clone(), inflight_rx) {
        tasks.spawn(crate::nats::nats_on_own_thread(app.clone(), url, rx, stop_rx.clone()));
    }
    let (app2, mut stop) = (app.clone(), stop_rx.clone());
    tasks.spawn(async move {
        let mut t = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = t.tick() => app2.tick(),
                _ = stop.changed() => break,
            }
        }
    });
    if let Some(l) = admin {
        let (router, mut stop) = (crate::admin::router(app.clone()), stop_rx.clone());
        tasks.spawn(async move {
            let _ = axum::serve(l, router)
                .with_graceful_shutdown(async move {
                    let _ = stop.changed().await;
                })
                .await;
        });
    }
    tasks
}

/// The gRPC port: Router, the endpoint picker and grpc.health.v1, until
/// `shutdown`.
async fn serve_grpc(
    builder: tonic::transport::Server,
    app: &Arc<App>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RouterServer<Service>>().await;
    let metrics = GrpcMetrics::register(app);
    let svc = RouterServer::new(Service::new(app.clone(), metrics.clone()))
        .max_decoding_message_size(app.config.max_prompt_bytes + (1 << 20));
    // The endpoint picker (Gateway API Inference Extension) on the same port.
    let epp = ExternalProcessorServer::new(kvgate_epp::EndpointPicker::new(app.clone()))
        .max_decoding_message_size(app.config.max_prompt_bytes + (2 << 20));
    health_reporter
        .set_service_status("envoy.service.ext_proc.v3.ExternalProcessor", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    // Every error status (ours, and tonic's own for undecodable requests) is
    // a trailers-only response: count it from the headers.
    let count_errors = tower::util::MapResponseLayer::new(move |resp: http::Response<tonic::body::Body>| {
        if let Some(code) = resp.headers().get("grpc-status").and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok())
        {
            metrics.count(tonic::Code::from_i32(code));
        }
        resp
    });
    // Pick requests carry whole prompts (~0.5 MB at 100K tokens): windows
    // and frames large enough that a request arrives without waiting for
    // WINDOW_UPDATEs, in few frames (measured: `make bench-gateway`).
    let mut builder = builder
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(32 << 20))
        .max_frame_size(Some(1 << 20))
        .layer(count_errors);
    builder
        .add_service(health_service)
        .add_service(svc)
        .add_service(epp)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| ServeError::Grpc(e.to_string()))
}

/// The gRPC port's TLS settings from the configured PEM files.
fn server_tls(files: &kvgate_core::config::TlsFiles) -> Result<tonic::transport::ServerTlsConfig, ServeError> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| ServeError::Tls(format!("{}: {e}", p.display())));
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read(&files.cert)?, read(&files.key)?));
    if let Some(ca) = &files.client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(tls)
}

/// Waits for Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Convenience for tests and embedding: `run` on a background task.
pub async fn spawn(config: Config) -> Result<(Bound, Arc<App>, Handle), ServeError> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (btx, brx) = tokio::sync::oneshot::channel();
    let join = tokio::spawn(run(
        config,
        async move {
            let _ = rx.await;
        },
        move |b, app| {
            let _ = btx.send((b, app));
        },
    ));
    match brx.await {
        Ok((b, app)) => Ok((b, app, Handle { stop: Some(tx), join: Some(join) })),
        Err(_) => match join.await {
            Ok(Err(e)) => Err(e),
            _ => Err(ServeError::Grpc("server ended before binding".into())),
        },
    }
}

/// A running server started by [`spawn`].
#[derive(Debug)]
pub struct Handle {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<Result<(), ServeError>>>,
}

impl Handle {
    /// Stops the server gracefully and waits for it.
    pub async fn stop(mut self) -> Result<(), ServeError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.join.take() {
            Some(j) => j.await.unwrap_or_else(|e| Err(ServeError::Grpc(e.to_string()))),
            None => Ok(()),
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
