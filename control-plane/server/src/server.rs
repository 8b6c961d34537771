//! The network side: gRPC (Pick, Report, health), NATS (events, heartbeats,
//! replica sync, snapshots), admin HTTP, periodic upkeep, graceful shutdown.
//!
//! ```text
//! run ─┬─ tonic server (Router + grpc.health.v1)      ── App::pick / App::report
//!      ├─ NATS task: one subscription on "<prefix>.>" ── App::on_nats ──▶ snapshot tasks
//!      ├─ replica-sync publisher (batches per model)
//!      ├─ admin HTTP (axum): /metrics /healthz /readyz /admin/*
//!      └─ ticker (250 ms): App::tick (dead workers, expired requests)
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt as _;
use kvgate_protocol::pb;
use prost::Message as _;
use tonic::{Request, Response, Status};

use crate::app::{App, Model};
use crate::config::Config;
use crate::router_server::{Router, RouterServer};

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Startup failed (models).
    #[error(transparent)]
    Start(#[from] crate::app::StartError),
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

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct Service {
    app: Arc<App>,
}

#[tonic::async_trait]
impl Router for Service {
    async fn pick(&self, request: Request<pb::PickRequest>) -> Result<Response<pb::PickResponse>, Status> {
        // Errors are counted by the response layer (they travel in headers).
        let r = self.app.pick(request.get_ref());
        if r.is_ok() {
            self.app.count_status(tonic::Code::Ok);
        }
        r.map(Response::new)
    }

    async fn report(&self, request: Request<pb::CompletionReportBatch>) -> Result<Response<pb::ReportAck>, Status> {
        self.app.count_status(tonic::Code::Ok);
        Ok(Response::new(self.app.report(request.get_ref())))
    }
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
    let (app, inflight_rx) = App::new(config)?;
    let cfg = &app.config;
    let grpc_listener = tokio::net::TcpListener::bind(cfg.listen_grpc)
        .await
        .map_err(|source| ServeError::Bind { addr: cfg.listen_grpc, source })?;
    let grpc_addr = grpc_listener.local_addr().map_err(|source| ServeError::Bind { addr: cfg.listen_grpc, source })?;
    let admin_listener = match cfg.listen_admin {
        Some(a) => Some(tokio::net::TcpListener::bind(a).await.map_err(|source| ServeError::Bind { addr: a, source })?),
        None => None,
    };
    let admin_addr = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();

    // NATS.
    if let Some(url) = cfg.nats_url.clone() {
        let app2 = app.clone();
        tasks.spawn(nats_task(app2, url, inflight_rx, stop_rx.clone()));
    }
    // Upkeep.
    {
        let app2 = app.clone();
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            let mut t = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = t.tick() => app2.tick(),
                    _ = stop.changed() => break,
                }
            }
        });
    }
    // Admin.
    if let Some(l) = admin_listener {
        let app2 = app.clone();
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            let router = crate::admin::router(app2);
            let _ = axum::serve(l, router)
                .with_graceful_shutdown(async move {
                    let _ = stop.changed().await;
                })
                .await;
        });
    }

    on_bound(Bound { grpc: grpc_addr, admin: admin_addr }, app.clone());
    tracing::info!(grpc = %grpc_addr, admin = ?admin_addr, replica = %app.config.replica_id, "control plane listening");

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RouterServer<Service>>().await;
    let svc = RouterServer::new(Service { app: app.clone() })
        .max_decoding_message_size(app.config.max_prompt_bytes + (1 << 20));
    // The endpoint picker (Gateway API Inference Extension) on the same port.
    let epp = crate::ext_proc::external_processor_server::ExternalProcessorServer::new(
        crate::epp::EndpointPicker::new(app.clone()),
    )
    .max_decoding_message_size(app.config.max_prompt_bytes + (2 << 20));
    health_reporter
        .set_service_status("envoy.service.ext_proc.v3.ExternalProcessor", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true));
    // Every error status (ours, and tonic's own for undecodable requests) is
    // a trailers-only response: count it from the headers.
    let app_l = app.clone();
    let count_errors = tower::util::MapResponseLayer::new(move |resp: http::Response<tonic::body::Body>| {
        if let Some(code) = resp.headers().get("grpc-status").and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok())
        {
            app_l.count_status(tonic::Code::from_i32(code));
        }
        resp
    });
    // Pick requests carry whole prompts (~0.5 MB at 100K tokens): windows
    // and frames large enough that a request arrives without waiting for
    // WINDOW_UPDATEs, in few frames (measured: `make bench-gateway`).
    let result = builder
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(32 << 20))
        .max_frame_size(Some(1 << 20))
        .layer(count_errors)
        .add_service(health_service)
        .add_service(svc)
        .add_service(epp)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    result.map_err(|e| ServeError::Grpc(e.to_string()))
}

/// The gRPC port's TLS settings from the configured PEM files.
fn server_tls(files: &crate::config::TlsFiles) -> Result<tonic::transport::ServerTlsConfig, ServeError> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| ServeError::Tls(format!("{}: {e}", p.display())));
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read(&files.cert)?, read(&files.key)?));
    if let Some(ca) = &files.client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(tls)
}

async fn nats_task(
    app: Arc<App>,
    url: String,
    mut inflight_rx: tokio::sync::mpsc::UnboundedReceiver<(String, pb::InflightEvent)>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    // Connect with retries: the control plane serves (by load) meanwhile.
    let client = loop {
        let nurl = kvgate_protocol::nats_url::split_nats_url(&url);
        let opts = nurl
            .auth
            .connect_options(async_nats::ConnectOptions::new())
            .name(format!("kvgate-control-plane {}", app.config.replica_id))
            .retry_on_initial_connect()
            .max_reconnects(None);
        match opts.connect(nurl.servers.as_str()).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!(error = %e, "NATS connect failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {},
                    _ = stop.changed() => return,
                }
            }
        }
    };
    let mut sub = match client.subscribe(format!("{}.>", app.subjects.prefix())).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "NATS subscribe failed");
            return;
        }
    };
    let mut state_poll = tokio::time::interval(Duration::from_millis(100));
    let mut was_connected = false;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = sub.next() => {
                let Some(msg) = msg else { break };
                for (model, worker) in app.on_nats(msg.subject.as_str(), &msg.payload) {
                    tokio::spawn(snapshot_task(app.clone(), client.clone(), model, worker));
                }
            }
            ev = inflight_rx.recv() => {
                let Some(first) = ev else { continue };
                let mut by_model: std::collections::HashMap<String, Vec<pb::InflightEvent>> = Default::default();
                by_model.entry(first.0).or_default().push(first.1);
                while let Ok((m, e)) = inflight_rx.try_recv() {
                    let v = by_model.entry(m).or_default();
                    v.push(e);
                    if v.len() >= 512 { break; }
                }
                for (model, events) in by_model {
                    let batch = pb::InflightBatch { replica_id: app.config.replica_id.clone(), model: model.clone(), events };
                    match client.publish(app.subjects.inflight(&model), batch.encode_to_vec().into()).await {
                        Ok(()) => app.global.inflight_published.fetch_add(1, Ordering::Relaxed),
                        Err(_) => app.global.inflight_publish_errors.fetch_add(1, Ordering::Relaxed),
                    };
                }
            }
            _ = state_poll.tick() => {
                let up = client.connection_state() == async_nats::connection::State::Connected;
                app.nats_connected.store(up, Ordering::Relaxed);
                if up && !was_connected {
                    tracing::info!("NATS connected");
                } else if !up && was_connected {
                    tracing::warn!("NATS disconnected; reconnecting");
                }
                was_connected = up;
            }
        }
    }
    app.nats_connected.store(false, Ordering::Relaxed);
}

/// Asks a relay for a snapshot and applies it; retries (bounded) while the
/// result leaves the worker needing another one.
async fn snapshot_task(app: Arc<App>, client: async_nats::Client, model: Arc<Model>, worker: String) {
    let timeout = Duration::from_millis(app.config.snapshot_timeout_ms);
    for attempt in 0..4u32 {
        app.global.snapshot_requests.fetch_add(1, Ordering::Relaxed);
        let subject = app.subjects.snapshot(&model.name, &worker);
        match fetch_snapshot(&client, subject, &app.config.replica_id, timeout).await {
            Ok(chunks) => {
                let now = app.now_ms();
                let again = model.state.lock().on_snapshot(&worker, &chunks, now);
                tracing::debug!(model = %model.name, %worker, chunks = chunks.len(), "snapshot applied");
                if again.is_none() {
                    return;
                }
            }
            Err(e) => {
                app.global.snapshot_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(model = %model.name, %worker, error = %e, "snapshot failed");
                model.state.lock().snapshot_failed(&worker);
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
    }
}

/// Sends a `SnapshotRequest` and collects every chunk of the reply.
pub async fn fetch_snapshot(
    client: &async_nats::Client,
    subject: String,
    requester: &str,
    timeout: Duration,
) -> Result<Vec<pb::SnapshotChunk>, String> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
    let req = pb::SnapshotRequest { requester: requester.to_owned(), max_chunk_bytes: 0 };
    client.publish_with_reply(subject, inbox, req.encode_to_vec().into()).await.map_err(|e| e.to_string())?;
    client.flush().await.map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut chunks: Vec<Option<pb::SnapshotChunk>> = Vec::new();
    let mut got = 0usize;
    loop {
        let msg = tokio::time::timeout_at(deadline, sub.next())
            .await
            .map_err(|_| format!("timed out after {} of {} chunks", got, chunks.len().max(1)))?
            .ok_or("subscription closed")?;
        let c = pb::SnapshotChunk::decode(msg.payload.as_ref()).map_err(|e| format!("malformed chunk: {e}"))?;
        let n = c.chunk_count.max(1) as usize;
        if chunks.is_empty() {
            chunks.resize_with(n, || None);
        }
        if n != chunks.len() || c.chunk_index as usize >= n {
            return Err("inconsistent chunk numbering".into());
        }
        let i = c.chunk_index as usize;
        if chunks[i].is_none() {
            got += 1;
        }
        chunks[i] = Some(c);
        if got == n {
            let _ = sub.unsubscribe().await;
            return Ok(chunks.into_iter().flatten().collect());
        }
    }
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
