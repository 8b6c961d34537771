//! Admin HTTP (loopback by default): Prometheus metrics, health, workers,
//! index statistics and the run-time mode switch.
//!
//! | route | what |
//! |---|---|
//! | `GET /metrics` | OpenMetrics text (`prometheus-client`) |
//! | `GET /healthz` | 200 while the process serves |
//! | `GET /readyz` | 200 when NATS is connected (or not configured), else 503 |
//! | `GET /admin/workers[?model=M]` | workers per model (JSON) |
//! | `GET /admin/index` | index and tokenizer statistics per model (JSON) |
//! | `GET /admin/timing` | engine timing learned per model and worker class (JSON) |
//! | `POST /admin/timing/journal` | the observations the timing fits learned from since the last call, per model (JSON; the first call starts the journal, bounded) |
//! | `POST /admin/mode?model=M&mode=kv` | switch a model's routing mode |

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};

use kvgate_core::App;
use kvgate_core::metrics::CONTENT_TYPE;

/// The admin routes.
pub fn router(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/admin/workers", get(workers))
        .route("/admin/index", get(index))
        .route("/admin/timing", get(timing))
        .route("/admin/timing/journal", post(timing_journal))
        .route("/admin/mode", post(mode))
        .with_state(app)
}

async fn metrics(State(app): State<Arc<App>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], app.render_metrics())
}

async fn ready(State(app): State<Arc<App>>) -> impl IntoResponse {
    if app.config.nats_url.is_none() || app.nats_connected() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "NATS not connected\n")
    }
}

async fn workers(State(app): State<Arc<App>>, Query(q): Query<HashMap<String, String>>) -> impl IntoResponse {
    axum::Json(app.workers_json(q.get("model").map(String::as_str)))
}

async fn index(State(app): State<Arc<App>>) -> impl IntoResponse {
    axum::Json(app.index_json())
}

async fn timing(State(app): State<Arc<App>>) -> impl IntoResponse {
    axum::Json(app.timing_json())
}

async fn timing_journal(State(app): State<Arc<App>>) -> impl IntoResponse {
    axum::Json(app.timing_journal())
}

async fn mode(State(app): State<Arc<App>>, Query(q): Query<HashMap<String, String>>) -> impl IntoResponse {
    let (Some(model), Some(mode)) = (q.get("model"), q.get("mode")) else {
        return (
            StatusCode::BAD_REQUEST,
            "expected ?model=NAME&mode=kv|approx|least_load|round_robin|random\n".to_owned(),
        );
    };
    match app.set_mode(model, mode) {
        Ok(()) => (StatusCode::OK, format!("{model}: mode {mode}\n")),
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}
