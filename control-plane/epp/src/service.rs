//! The tonic adapter: `envoy.service.ext_proc.v3.ExternalProcessor/Process`,
//! one task per stream feeding an [`crate::exchange::Exchange`].

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use kvgate_core::App;
use tonic::{Request, Response, Status, Streaming};

use kvgate_core::app::HEAVY_PROMPT_BYTES;

use crate::EppMetrics;
use crate::exchange::Exchange;
use crate::ext_proc::external_processor_server::ExternalProcessor;
use crate::ext_proc::{ProcessingRequest, ProcessingResponse, processing_request};

/// The ext_proc service.
#[derive(Debug, Clone)]
pub struct EndpointPicker {
    app: Arc<App>,
    metrics: EppMetrics,
}

impl EndpointPicker {
    /// A picker routing with `app`.
    pub fn new(app: Arc<App>) -> Self {
        let metrics = EppMetrics::register(&app);
        Self { app, metrics }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = Answers;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Answers>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<ProcessingResponse, Status>>(16);
        let (app, metrics) = (self.app.clone(), self.metrics.clone());
        tokio::spawn(async move {
            let mut x = Exchange::new(app, metrics.clone());
            loop {
                match inbound.message().await {
                    Ok(Some(msg)) => {
                        // The message that completes a large body runs the
                        // Pick (tokenization): off the scheduler's hands.
                        let heavy = x.buffered_bytes() + body_len(&msg) > HEAVY_PROMPT_BYTES;
                        for answer in off_scheduler(heavy, || x.on_message(msg)) {
                            if tx.send(Ok(answer)).await.is_err() {
                                x.finish();
                                return;
                            }
                        }
                    }
                    Ok(None) => break,
                    Err(_) => {
                        metrics.stream_errors.inc();
                        break;
                    }
                }
            }
            x.finish();
        });
        let answers = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|a| (a, rx)) });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// Bytes of request body a message carries.
fn body_len(msg: &ProcessingRequest) -> usize {
    match &msg.request {
        Some(processing_request::Request::RequestBody(b)) => b.body.len(),
        _ => 0,
    }
}

/// Runs `f` with `tokio::task::block_in_place` when it is `heavy` and the
/// runtime has other threads to take over (inline otherwise): the one way
/// the adapters run a Pick whose tokenization is CPU work.
pub fn off_scheduler<T>(heavy: bool, f: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if heavy && multi { tokio::task::block_in_place(f) } else { f() }
}
