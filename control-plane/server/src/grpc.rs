//! The gRPC adapter: `kvgate.v1.Router` (Pick, Report) over the core, with
//! the core's domain errors mapped to gRPC status codes here and nowhere
//! else, and every response counted by code.
//!
//! | core | gRPC |
//! |---|---|
//! | `Ok` | OK |
//! | `PickError::Resend` | OK with `resend: true` (the filter sends the elided messages) |
//! | `PickError::UnknownModel` | NOT_FOUND |
//! | `PickError::Invalid` | INVALID_ARGUMENT |
//! | `PickError::NoWorkers` | UNAVAILABLE |
//! | `PickError::Held` | (waited for here: the ticket's release, then a pick) |
//! | `PickError::Overloaded` | OK with `retry_after_ms` (the filter answers 429) |

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::app::{HEAVY_PROMPT_BYTES, prompt_bytes};
use kvgate_core::{App, PickError};
use kvgate_protocol::pb;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tonic::{Code, Request, Response, Status};

use crate::held::{Held, Wake};
use crate::router_server::Router;

/// `{code}` of a gRPC response (the numeric code, as gRPC writes it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CodeLabel {
    code: u8,
}

/// gRPC responses by status code, registered in the app's registry.
#[derive(Debug, Clone)]
pub struct GrpcMetrics {
    responses: Family<CodeLabel, Counter>,
}

impl GrpcMetrics {
    /// Registers `kvgate_grpc_responses_total{code}`.
    pub fn register(app: &App) -> Self {
        let m = Self { responses: Family::default() };
        app.metrics.register("kvgate_grpc_responses", "gRPC responses by status code.", m.responses.clone());
        m
    }

    /// Counts one response.
    pub fn count(&self, code: Code) {
        self.responses.get_or_create(&CodeLabel { code: code as u8 }).inc();
    }
}

/// The core's refusal as a gRPC answer.
pub fn to_grpc(e: PickError) -> Result<pb::PickResponse, Status> {
    match e {
        PickError::Resend => Ok(pb::PickResponse { resend: true, ..Default::default() }),
        PickError::UnknownModel(_) => Err(Status::not_found(e.to_string())),
        PickError::Invalid(_) => Err(Status::invalid_argument(e.to_string())),
        PickError::NoWorkers { .. } => Err(Status::unavailable(e.to_string())),
        PickError::Overloaded { retry_after_ms } => Ok(pb::PickResponse { retry_after_ms, ..Default::default() }),
        // Waited for by the service; never answered as such.
        PickError::Held { .. } => Err(Status::unavailable(e.to_string())),
    }
}

/// The `kvgate.v1.Router` service.
#[derive(Clone)]
pub struct Service {
    app: Arc<App>,
    metrics: GrpcMetrics,
    held: Held,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

impl Service {
    /// The service over `app`, counting responses in `metrics` (starts the
    /// task that releases held picks: call inside a tokio runtime).
    pub fn new(app: Arc<App>, metrics: GrpcMetrics) -> Self {
        let held = Held::start(&app);
        Self { app, metrics, held }
    }

    /// A pick the admission queue held: waits for its release (then picks)
    /// or its deadline (then refuses).
    async fn wait_held(
        &self,
        req: &pb::PickRequest,
        ticket: kvgate_core::Ticket,
    ) -> Result<pb::PickResponse, PickError> {
        let waiter = self.held.wait(&self.app, &req.model, ticket);
        // The core expires the ticket at its deadline; this bound only
        // covers a releasing task that stopped.
        let limit = Duration::from_millis(u64::from(self.app.retry_after_ms(&req.model)) + 1000);
        match waiter.wake(limit).await {
            Wake::Go => {
                let heavy = prompt_bytes(req) > HEAVY_PROMPT_BYTES;
                kvgate_epp::service::off_scheduler(heavy, || self.app.pick_released(req))
            }
            Wake::Expired => Err(self.app.overloaded(&req.model)),
        }
    }
}

#[tonic::async_trait]
impl Router for Service {
    async fn pick(&self, request: Request<pb::PickRequest>) -> Result<Response<pb::PickResponse>, Status> {
        let req = request.get_ref();
        // Tokenizing a large prompt is CPU work: off the scheduler's hands.
        let r = kvgate_epp::service::off_scheduler(prompt_bytes(req) > HEAVY_PROMPT_BYTES, || self.app.pick(req));
        let r = match r {
            Err(PickError::Held { ticket }) => self.wait_held(req, ticket).await,
            r => r,
        };
        // Errors are counted by the response layer (they travel in headers).
        let r = r.or_else(to_grpc);
        if r.is_ok() {
            self.metrics.count(Code::Ok);
        }
        r.map(Response::new)
    }

    async fn report(&self, request: Request<pb::CompletionReportBatch>) -> Result<Response<pb::ReportAck>, Status> {
        self.metrics.count(Code::Ok);
        let ack = self.app.report(request.get_ref());
        // Finished requests free batch slots for held picks.
        self.held.poke();
        Ok(Response::new(ack))
    }
}
