//! The tonic adapter: `envoy.service.ext_proc.v3.ExternalProcessor/Process`,
//! one task per stream feeding an [`crate::exchange::Exchange`].

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use kvgate_core::App;
use tonic::{Request, Response, Status, Streaming};

use crate::EppMetrics;
use crate::exchange::Exchange;
use crate::ext_proc::external_processor_server::ExternalProcessor;
use crate::ext_proc::{ProcessingRequest, ProcessingResponse};

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
                        for answer in x.on_message(msg) {
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
